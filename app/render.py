"""Events to what the UI shows: highlighted token spans, the stats panel, the chart rows. Pure functions, no Gradio.

Everything here takes the engine's events (`usd.events`) or plain values, so it is unit-tested on hand-made events.
"""

from __future__ import annotations

import html
import itertools
import time
from dataclasses import dataclass, field

from usd.algorithms import LOOKING_UP, PLAIN, SPECS, Algorithm
from usd.events import KINDS, Finished, Piece, Round, Source, SourceState, Stats

KIND_LABELS = {
    "accepted": "accepted: drafted and kept",
    "rejected": "rejected: drafted, thrown away",
    "resampled": "resampled: the target's correction",
    "bonus": "bonus: the target's extra token",
    "target": "target: plain decoding",
}
SLOWER = 0.95
"""Below this measured (or estimated) speedup, the panel says in words that speculation is costing time."""
CHART_ACCEPTED = "drafted tokens accepted"
CHART_EMITTED = "tokens emitted"
"""The per-round chart's two lines (its legend): the drafts the target kept, and every token the round added."""
CHART_TITLE = "Tokens per round: accepted drafts and emitted"


def piece_title(piece: Piece) -> str:
    ids = f"target id {piece.target_id}" if piece.target_id is not None else "no target id"
    if piece.drafter_ids:
        ids += f", drafter ids {', '.join(map(str, piece.drafter_ids))}"
    source = f" · drafted by {piece.source}" if piece.source else ""
    if piece.copied_from is not None:
        source += f", copied from position {piece.copied_from}"
    return f"round {piece.round} · {piece.kind}{source} · {ids}"


def piece_span(piece: Piece) -> str:
    if piece.kind not in KINDS:
        raise ValueError(f"unknown piece kind {piece.kind!r}")
    tag = "s" if piece.kind == "rejected" else "span"
    # The token view keeps white space (CSS pre-wrap); a token that is only spaces gets a class that shades it, so
    # it can still be seen and hovered.
    blank = " tok-blank" if piece.text and not piece.text.strip() else ""
    looked_up = _lookup_mark(piece.source)
    return (
        f'<{tag} class="tok tok-{piece.kind}{blank}{looked_up}" data-kind="{piece.kind}" data-round="{piece.round}" '
        f'title="{html.escape(piece_title(piece), quote=True)}">{html.escape(piece.text)}</{tag}>'
    )


def _lookup_mark(source: str) -> str:
    """Drafted by no model: a mark of its own, and one per lookup (tok-ngram, tok-suffix), so that each shows apart."""
    if source not in LOOKING_UP:  # (a third-party server may name a source this engine does not know)
        return ""
    return f" tok-lookup tok-{source}"


def pieces_spans(pieces) -> str:
    """The pieces' spans, rejected ones included (struck through), in the order the rounds produced them."""
    return "".join(piece_span(p) for p in pieces if p.text or p.kind == "rejected")


def pieces_html(pieces: list[Piece] | tuple[Piece, ...]) -> str:
    """Every piece in the token view's box."""
    return f'<div class="tokens">{pieces_spans(pieces)}</div>'


class TokenFeed:
    """What a token view is sent: the spans of the pieces it has not shown yet, with the range of pieces they cover,
    so an update costs the new pieces (on the wire, in the app and in the browser, which appends them: app/views.py
    LIVE_JS), not the whole answer again. A feed's first update, and its last (`whole`), carry every piece from the
    first: the page starts its box afresh on them, so nothing it missed stays missing."""

    _runs = itertools.count(1)

    def __init__(self):
        self.run = next(self._runs)
        self.sent = 0

    def update(self, pieces, whole: bool = False) -> dict:
        start = 0 if whole else self.sent
        self.sent = len(pieces)
        return {"run": self.run, "from": start, "to": self.sent, "html": pieces_spans(pieces[start:])}


class LiveFeed:
    """What a live view (app/views.py `live_view`: a token view with, as the view has them, a heading, the stats panel
    and the per-round chart, one component on the page) is sent per update: the new pieces (TokenFeed), the chart's
    new rows in the same way, and the heading and panel whole (they are small). One output instead of one per part:
    the page's per-update work (Gradio's bookkeeping of every output of an event) grows with the outputs."""

    def __init__(self):
        self.tokens = TokenFeed()
        self.rows_sent = 0

    def update(self, live: Live | None, whole: bool = False, **parts: str) -> dict:
        """`parts`: the view's other parts as HTML, by name (head, stats)."""
        pieces, rows = (live.pieces, live.chart) if live is not None else ([], [])
        start = 0 if whole else self.rows_sent
        self.rows_sent = len(rows)
        return {"tokens": self.tokens.update(pieces, whole), "chart": {"from": start, "rows": rows[start:]}, **parts}

    @staticmethod
    def empty(**parts: str) -> dict:
        """An empty view (a cleared chat): a run of its own with no pieces and no rows."""
        return LiveFeed().update(None, **parts)


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{k}" title="{KIND_LABELS[k]}">{k}</span>' for k in KINDS)
    lookup = "".join(
        f'<span class="tok tok-accepted tok-lookup tok-{name}" title="drafted by {words}">{label}</span>'
        for name, words, label in (
            ("ngram", "n-gram lookup, no model", "looked up"),
            ("suffix", "earlier answers, no model", "remembered"),
        )
    )
    hint = "hover a token for its round, ids and source"
    return f'<div class="legend">{items}{lookup}<span class="legend-hint">{hint}</span></div>'


@dataclass
class Live:
    """One generation as the UI shows it: its pieces, the chart's rows, and the engine's own running numbers (every
    event carries them, computed as the final ones are, so live equals final)."""

    algorithm: Algorithm
    baseline_tokens_per_s: float | None = None
    """Plain decoding's tokens/s for this pair, measured earlier (the compare view, or a plain chat answer)."""
    earlier_speculative: tuple[str, float] | None = None
    """(algorithm, tokens/s) of an earlier speculative answer on this pair: what a plain answer is compared with."""
    started: float = field(default_factory=time.perf_counter)
    pieces: list[Piece] = field(default_factory=list)
    k: int = 0
    expected_speedup: float | None = None
    """What auto's cost model expected of the last round's (algorithm, k), against plain decoding."""
    choice: str | None = None
    """Auto's last choice in words: what it ran and why (see `auto_choice`)."""
    stats: Stats | None = None
    chart: list[tuple[int, int, int]] = field(default_factory=list)
    """The per-round chart's rows: (round, drafted tokens accepted, tokens emitted)."""
    finished: Finished | None = None

    def add(self, event: Round | Finished) -> None:
        self.stats = event.stats
        if isinstance(event, Finished):
            self.finished = event
            return
        self.pieces.extend(event.pieces)
        self.k = event.k
        self.expected_speedup = event.expected_speedup
        if self.algorithm.chooses:
            self.choice = auto_choice(event)
        emitted = len([p for p in event.emitted if p.target_id is not None])
        self.chart.append((event.index, event.accepted, emitted))

    @property
    def elapsed(self) -> float:
        if self.finished is not None:
            return self.finished.stats.wall_s
        return time.perf_counter() - self.started

    def numbers(self) -> dict:
        """tokens/s, alpha, tau, k, c, v, theoretical speedup and (when a baseline is known) measured speedup."""
        s = self.stats
        if s is None:
            return {
                "tokens_per_s": 0.0,
                "acceptance_rate": None,
                "tokens_per_round": 0.0,
                "k": self.k,
                "mean_k": None,
                "c": None,
                "v": None,
                "theoretical_speedup": None,
                "tokens": 0,
                "rounds": 0,
                "wall_s": self.elapsed,
                "stop_reason": None,
                "measured_speedup": None,
                "speedup_basis": None,
                "expected_speedup": None,
                "choice": self.choice,
                "unreported": (),
            }
        out = {
            **s.as_dict(),  # the engine's numbers, as every consumer reads them; then what only the panel shows
            "acceptance_rate": s.acceptance_rate if s.drafted else None,
            "k": self.k,
            "measured_speedup": None,
            "speedup_basis": None,
            "expected_speedup": self.expected_speedup,
            "choice": self.choice,
            "unreported": s.unreported,
        }
        if self.algorithm.plain:
            # plain decoding against plain decoding is no speedup: only an earlier speculative answer compares
            if self.earlier_speculative and s.tokens_per_s:
                algorithm, rate = self.earlier_speculative
                ratio = s.tokens_per_s / rate
                out["earlier_speculative"] = {"algorithm": algorithm, "tokens_per_s": rate, "ratio": ratio}
        elif self.baseline_tokens_per_s and s.tokens_per_s:
            out["measured_speedup"] = s.tokens_per_s / self.baseline_tokens_per_s
            out["speedup_basis"] = "against plain decoding measured earlier on this pair"
        elif s.plain_step_speedup is not None:
            # No plain run to compare with yet: the target's plain step (this answer's, or the one timed at load
            # while the answer has few) gives plain decoding's rate.
            out["measured_speedup"] = s.plain_step_speedup
            out["speedup_basis"] = "estimated from the target's plain step"
        return out


def auto_choice(event: Round) -> str:
    """What auto ran this round and the cost model's reason, in words, then why each other source is off."""
    why = _choice(event)
    off = [_source_text(s) for s in event.sources if s.state is not SourceState.IN_USE]
    return f"{why}. Off: {'; '.join(off)}" if off else why


def _choice(event: Round) -> str:
    if event.algorithm != PLAIN:  # (a third-party server may name none)
        return f"{event.algorithm} k={event.k}{_drafted_by(event.algorithm)}{_gain(event)}"
    if event.bound is not None:
        b = event.bound
        text = (
            f"plain decoding: the drafter model cannot pay on this machine. Even if every drafted token were "
            f"accepted, the best draft length (k={b.k}) would run at {b.speedup:.2f}x the target alone: "
            f"(k+1) / (k·c + v(k)) = {b.k + 1} / ({b.k}·{b.c:.2f} + {b.v:.2f}), with the drafter's step c = {b.c:.2f} "
            f"of the target's and a verify of {b.k + 1} tokens v({b.k}) = {b.v:.2f} steps, measured {b.measured}"
        )
        if event.declined is not None:  # what is left to weigh: a lookup, which drafts for free
            algorithm, k, speedup = event.declined
            text += f"; {algorithm} k={k}, drafting without the model, is expected at {speedup:.2f}x this round"
        return text
    if event.declined is None:
        return "plain decoding (still measuring)" if not event.sources else "plain decoding"
    algorithm, k, speedup = event.declined
    verdict = "speculation does not pay on this machine" if speedup < 1 else "re-measuring plain decoding"
    return f"plain decoding: the best speculation, {algorithm} k={k}, is expected at {speedup:.2f}x; {verdict}"


def _gain(event: Round) -> str:
    """The source in use's gain: what it achieved in this answer, else what the cost model expected."""
    used = next((s for s in event.sources if s.state is SourceState.IN_USE), None)
    if used is not None and used.speedup is not None and event.expected_speedup != used.speedup:
        return f", {used.speedup:.2f}x plain decoding in this answer so far"
    return f", expected {event.expected_speedup:.2f}x" if event.expected_speedup else ""


SOURCE_WORDS = {
    SourceState.CANNOT_PAY: "cannot pay on this machine: at most {x} with every drafted token accepted",
    SourceState.DROPPED: "dropped for this answer: its rounds ran at {x} plain decoding",
    SourceState.NO_MATCH: "the lookup finds no earlier text to copy here",
    SourceState.BUDGET: "trying it now could cost more than the answer's probing budget has left",
    SourceState.UNTRIED: "not tried yet",
    SourceState.LOSES: "expected at {x} plain decoding; tried again now and then",
    SourceState.SLOWER: "expected at {x}, less than the source in use",
}
"""Why a source is off, in words ({x}: its speedup)."""


def _source_text(source: Source) -> str:
    return f"{source.name}: {SOURCE_WORDS[source.state].format(x=fmt(source.speedup, '.2f', 'x'))}"


def _drafted_by(algorithm: str) -> str:
    """Which source an algorithm drafts from, in words (nothing for a name this engine does not know)."""
    spec = SPECS.get(algorithm)
    return f" ({spec.drafts_from})" if spec is not None else ""


def fmt(x, spec: str = ".2f", unit: str = "", missing: str = "–") -> str:
    """A number for a table cell, `missing` when there is none."""
    return missing if x is None else f"{x:{spec}}{unit}"


def speculation_cost_share(n: dict) -> float | None:
    """The most this answer's speculative rounds can have added to its time, as a share of it: each took k drafter
    steps of c and a verify of v target steps where a plain round takes one step (what they emitted beyond one token
    only took time back). None where a number it needs is missing."""
    rounds = n.get("rounds_by_algorithm") or {}
    speculative = sum(count for name, count in rounds.items() if name != PLAIN.value)
    step, wall, c, v, k = (n.get(key) for key in ("step_s", "wall_s", "c", "v", "mean_k"))
    if not speculative or not wall or None in (step, c, v, k):
        return None
    return speculative * (k * c + v - 1) * step / wall


def warning_text(n: dict, algorithm: Algorithm) -> str | None:
    """A plain-words warning when speculation is costing time on this pair and this hardware, with the cause its
    numbers show. None where it drafted nothing, or where its rounds cannot have cost the time missing (an auto answer
    that drafted in a few rounds, measured against another answer a little faster)."""
    speedup = n.get("measured_speedup")
    if algorithm.plain or speedup is None or speedup >= SLOWER or n.get("acceptance_rate") is None:
        return None  # (an answer that drafted nothing was not slowed by speculation)
    share = speculation_cost_share(n)
    if share is not None and share < 1 - SLOWER:
        return None
    c, v, k = n.get("c"), n.get("v"), n.get("mean_k")
    kept = f"only {fmt(n.get('acceptance_rate'), '.0%')} of drafts are kept"
    advice = (
        "auto falls back to plain decoding when it measures this"
        if not algorithm.chooses
        else "auto is still measuring and will fall back to plain decoding"
    )
    if c is not None and v is not None and k and k * c < v - 1:  # the verify, not the drafter, costs the round
        why = (
            f"Drafting is cheap here (a drafted token costs {c:.2f} of a target step), but checking the drafts costs "
            f"the target nearly as much as decoding them one by one (a verify costs {v:.2f} target steps), and "
            f"{kept} (typical on a CPU with few cores): {advice}; a GPU or more cores change the balance."
        )
    else:
        cost = f"Each drafted token costs {c:.2f} of a target step and {kept}. " if c is not None else ""
        why = (
            f"{cost}The drafter is too slow relative to the target here (typical on a CPU, or with a small target): "
            f"{advice}; a GPU, a bigger target or a smaller drafter changes the balance."
        )
    return (
        f"Speculation is slowing this pair down on this hardware: {speedup:.2f}x the speed of the target alone. {why}"
    )


STAT_LABELS = {
    "tokens_per_s": "tokens/s",
    "acceptance_rate": "acceptance α",
    "tokens_per_round": "tokens per target forward τ",
    "k": "draft length k",
    "c": "drafter cost c",
    "v": "verify cost v",
    "theoretical_speedup": "theoretical speedup",
    "expected_speedup": "expected speedup at this k",
    "measured_speedup": "measured speedup",
    "tokens": "the token count (counted here from the stream's chunks instead)",
}
"""The stats panel's name for each number that a source may leave unreported (`Stats.unreported`)."""


def unreported_text(n: dict) -> str | None:
    """In words, which numbers the source (a third-party server) did not report, or None when it reported them all."""
    missing = [STAT_LABELS[k] for k in n.get("unreported") or () if k in STAT_LABELS]
    if not missing:
        return None
    return (
        f"Not reported by this server: {', '.join(missing)}. (usd serve reports every number here; vLLM with "
        "per-request metrics on, its drafted and accepted tokens.)"
    )


def stats_html(n: dict, algorithm: Algorithm) -> str:
    rows = _plain_rows(n) if algorithm.plain else _speculative_rows(n)
    missing = {STAT_LABELS.get(k) for k in n.get("unreported") or ()}
    rows = [(label, "not reported" if label in missing else value) for label, value in rows]
    body = "".join(f'<tr><th>{k}</th><td data-stat="{k}">{v}</td></tr>' for k, v in rows)
    unreported = unreported_text(n)
    body += f'<tr><td colspan="2" class="unreported">{html.escape(unreported)}</td></tr>' if unreported else ""
    warn = warning_text(n, algorithm)
    warn_html = f'<div class="slow-warning">⚠ {html.escape(warn)}</div>' if warn else ""
    stop = n.get("stop_reason")
    end = f'<div class="stop-reason">stopped: {html.escape(stop)}</div>' if stop else ""
    return f'<div class="stats"><table>{body}</table>{warn_html}{end}</div>'


def _counts_row(n: dict) -> tuple[str, str]:
    return "tokens · rounds · seconds", f"{n.get('tokens', 0)} · {n.get('rounds', 0)} · {fmt(n.get('wall_s'), '.1f')}"


def _plain_rows(n: dict) -> list[tuple[str, str]]:
    """Plain decoding: its speed, and an earlier speculative answer's beside it, when there is one."""
    rows = [("tokens/s", fmt(n.get("tokens_per_s"), ".1f"))]
    earlier = n.get("earlier_speculative")
    if earlier:
        rows.append(
            (
                f"an earlier speculative answer ({html.escape(earlier['algorithm'])})",
                f"{earlier['tokens_per_s']:.1f} tokens/s <small>(this plain answer: {earlier['ratio']:.2f}x of "
                "it)</small>",
            )
        )
    return [*rows, _counts_row(n)]


def _speculative_rows(n: dict) -> list[tuple[str, str]]:
    return [
        ("tokens/s", fmt(n.get("tokens_per_s"), ".1f")),
        ("acceptance α", fmt(n.get("acceptance_rate"), ".0%")),
        ("tokens per target forward τ", fmt(n.get("tokens_per_round"), ".2f")),
        ("draft length k", str(n.get("k") if n.get("k") is not None else "–")),
        ("drafter cost c", fmt(n.get("c"), ".2f")),
        ("verify cost v", fmt(n.get("v"), ".2f")),
        ("theoretical speedup", fmt(n.get("theoretical_speedup"), ".2f", "x")),
        ("expected speedup at this k", fmt(n.get("expected_speedup"), ".2f", "x")),
        *([("auto's choice", html.escape(n["choice"]))] if n.get("choice") else []),
        (
            "measured speedup",
            fmt(n.get("measured_speedup"), ".2f", "x")
            + (f" <small>({n['speedup_basis']})</small>" if n.get("speedup_basis") else ""),
        ),
        _counts_row(n),
    ]


def answer_text(live: Live) -> str:
    """The answer so far: the emitted pieces' text, or the engine's final text once it is done."""
    if live.finished is not None:
        return live.finished.text
    return "".join(p.text for p in live.pieces if p.kind != "rejected")


COMPARE_ORDER = "one after the other: plain decoding first, then speculative, so neither slows the other"


def first_difference(a, b) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return min(len(a), len(b)) if first is None and len(a) != len(b) else first


def compare_summary(plain: Finished, speculative: Finished, greedy: bool, divergence=None) -> dict:
    """Both times, the speedup, tokens/s, and whether the answers are token-identical (a must when greedy). With
    `divergence` (usd.numerics.Divergence at the first difference), whether that was a near-tie."""
    first = first_difference(plain.target_ids, speculative.target_ids)
    ps, ss = plain.stats.wall_s, speculative.stats.wall_s
    return {
        "identical": first is None,
        "greedy": greedy,
        "first_difference": first,
        "plain_s": ps,
        "speculative_s": ss,
        "speedup": ps / ss if ss > 0 else None,
        "plain_tokens_per_s": plain.stats.tokens_per_s,
        "speculative_tokens_per_s": speculative.stats.tokens_per_s,
        "acceptance_rate": speculative.stats.acceptance_rate,
        "tokens_per_round": speculative.stats.tokens_per_round,
        "algorithm": speculative.stats.algorithm,
        "order": COMPARE_ORDER,
        "near_tie": divergence.near_tie if divergence else None,
        "logit_gap": divergence.gap if divergence else None,
        "difference_explained": divergence.explain() if divergence else None,
    }


def summary_html(s: dict) -> str:
    speed = s["speedup"]
    verdict = "faster" if speed and speed >= 1 else "slower"
    if s["identical"]:
        same = "✔ token-identical outputs" + (" (greedy: they must be)" if s["greedy"] else "")
        cls = "same"
    elif s["greedy"]:
        same = f"✘ outputs differ from token {s['first_difference']}"
        if s.get("difference_explained"):
            same += f": {s['difference_explained']}"
            cls = "differ-ok" if s["near_tie"] else "differ"
        else:
            same += ": greedy outputs must be identical"
            cls = "differ"
    else:
        same = (
            f"outputs differ from token {s['first_difference']}: expected when sampling with an algorithm whose "
            "draws depend on where rounds are cut (tli, standard); both follow the target's distribution"
        )
        cls = "differ-ok"
    return (
        f'<div class="compare-summary"><b>plain {s["plain_s"]:.2f} s</b> ({s["plain_tokens_per_s"]:.1f} tok/s) · '
        f"<b>speculative {s['speculative_s']:.2f} s</b> ({s['speculative_tokens_per_s']:.1f} tok/s, "
        f"{s['algorithm']}, α {s['acceptance_rate']:.0%}) · <b>speedup {speed or 0:.2f}x</b> ({verdict})"
        f'<div class="compare-{cls}">{same}</div><small>Run {s["order"]}.</small></div>'
    )
