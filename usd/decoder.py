"""The one decode loop: draft -> verify -> commit -> yield. Plain decoding is the same loop with k = 0.

Each model keeps its own token context and KV cache (a runner's `new_context`: usd/runners); a round feeds only the
tokens the cache lacks and crops what the target rejected, so a round costs O(new tokens). The committed answer is held
as target ids. What drafts is a `drafting.Source` that the algorithm's row of the table starts: the loop asks it for
candidates and tells it what was committed, whatever it is.
docs/design.md walks through the loop, the events and why each algorithm is lossless.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .algorithms import PLAIN, Acceptance, Algorithm, runnable
from .drafters import room_after
from .drafting import Draft, Randomness, Rules, Source, Start, start_source
from .events import Finished, Piece, Round, Stats
from .pair import Pair, bytes_of
from .record import RoundRecord
from .sampling import DRAFTER_STREAM, SamplingParams, make_generator, probabilities
from .schedule import Schedule
from .settings import GenerationSettings, check_algorithm
from .tally import Tally
from .utf8 import piece_decoder
from .verify import exact_match, greedy_match, rejection_sampling


def _algorithm_and_k(settings: GenerationSettings) -> tuple[Algorithm, int | str]:
    """The algorithm and the draft length as the loop runs them: plain decoding drafts nothing."""
    return (PLAIN, 0) if settings.algorithm.plain else (settings.algorithm, settings.draft_tokens)


def resolve_algorithm(pair: Pair, algorithm: str) -> Algorithm:
    """Check that the algorithm can run on this pair; `auto` stays `auto` (the schedule picks per round: without a
    drafter among plain decoding and the lookups)."""
    chosen = check_algorithm(algorithm)
    problem = runnable(chosen, pair.drafter is not None, pair.same_tokenizer)
    if problem:
        raise ValueError(problem)
    return chosen


# --- one round -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What a round's verification decided: the first `accepted` candidates stand, then the target's own `token`
    (`resampled` at the first rejection, `bonus` after a fully accepted draft, `target` when nothing was drafted)."""

    accepted: int
    token: int
    kind: str


def accept(logits: torch.Tensor, draft: Draft, mode: Algorithm, rules: Rules, position: int) -> Verdict:
    """The algorithm's acceptance rule on the target's logits at each candidate and one past the last."""
    candidates, params, rng = draft.candidates, rules.params, rules.rng
    if params.greedy:
        accepted, token, kind = greedy_match(logits.argmax(-1).tolist(), candidates)
    else:
        p = probabilities(logits, params)
        if mode.spec.accepts is Acceptance.EXACT_MATCH or not candidates:
            accepted, token, kind = exact_match(p, candidates, rng.at_positions(position, len(candidates) + 1))
        else:
            accepted, token, kind = rejection_sampling(p, torch.stack(draft.q), candidates, rng.drafter)
    return Verdict(accepted, token, kind if candidates else "target")


@dataclass(frozen=True)
class RoundTimes:
    draft_s: float
    verify_s: float


def speculative_round(
    rules: Rules, target, source: Source | None, mode: Algorithm, k: int, position: int, target_room: int
) -> tuple[Draft, Verdict, RoundTimes]:
    """One round, as in the paper: the drafter proposes up to k candidates, the target scores all of them in one
    forward, the acceptance rule keeps a prefix and adds one token of the target's own; the target's cache is cut
    back to what stands. (Plain decoding: no source, no candidates, so this is one plain target step.)"""
    t0 = time.perf_counter()
    draft = (source.propose(k) if source is not None and k else Draft()).fitted(target_room)
    t1 = time.perf_counter()
    n_before = len(target.ids)
    target.ids.extend(draft.candidates)
    logits = target.forward(keep=len(draft.candidates) + 1)
    t2 = time.perf_counter()
    verdict = accept(logits, draft, mode, rules, position)
    target.truncate(n_before + verdict.accepted)
    target.ids.append(verdict.token)
    return draft, verdict, RoundTimes(t1 - t0, t2 - t1)


# --- the committed answer --------------------------------------------------------------------------------------------


class Answer:
    """The committed answer: its target ids and bytes, the text each piece shows, and the stop conditions."""

    def __init__(self, pair: Pair, max_new_tokens: int, stop_strings: tuple[str, ...]):
        self.tb = pair.target_bytes
        self.eos = pair.eos_ids()
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.stop_reach = max((len(s.encode()) for s in self.stop_strings), default=0) + 3  # +3: a cut character
        self.ids: list[int] = []
        self.committed = b""
        self.piece_text = piece_decoder()  # a piece shows the characters it completes; a split one waits for its rest
        self.stop_reason: str | None = None

    def commit(self, draft: Draft, verdict: Verdict, round_index: int, source: str = "") -> list[Piece]:
        """Append what the round emitted, up to a stop; return its pieces: accepted, rejected, then the target's."""
        emitted = draft.candidates[: verdict.accepted] + [verdict.token]
        pieces, new_bytes = [], b""
        for j, t in enumerate(emitted):
            if t in self.eos:  # eos ends the answer and is not part of its text
                self.stop_reason = "eos"
                break
            new_bytes += bytes_of(self.tb, t)
            kind = "accepted" if j < verdict.accepted else verdict.kind
            drafted = j < verdict.accepted
            pieces.append(
                Piece(
                    text=self.piece_text.decode(bytes_of(self.tb, t)),
                    kind=kind,
                    target_id=t,
                    round=round_index,
                    drafter_ids=draft.drafter_ids[j] if drafted else (),
                    source=source if drafted else "",
                    copied_from=_copied(draft, j) if drafted else None,
                )
            )
            if self._ends_with_stop_string(new_bytes):
                self.stop_reason = "stop_string"
            elif len(self.ids) + j + 1 >= self.max_new_tokens:
                self.stop_reason = "max_tokens"
            if self.stop_reason:
                break
        self.ids.extend(emitted[: len(pieces)])  # each piece is the emitted token of the same index
        self.committed += new_bytes
        kept = min(verdict.accepted, len(pieces))
        return pieces[:kept] + self._rejected(draft, verdict, round_index, source) + pieces[kept:]

    def _rejected(self, draft: Draft, verdict: Verdict, round_index: int, source: str) -> list[Piece]:
        return [
            Piece(
                text=bytes_of(self.tb, t).decode("utf-8", "replace"),
                kind="rejected",
                target_id=t,
                round=round_index,
                drafter_ids=draft.drafter_ids[j],
                source=source,
                copied_from=_copied(draft, j),
            )
            for j, t in enumerate(draft.candidates)
            if j >= verdict.accepted
        ]

    def _ends_with_stop_string(self, new: bytes) -> bool:
        """Whether `new`, the round's bytes so far after the committed answer, completed a stop string. A stop string
        they completed lies in the tail they end, so only that tail is read: a check costs the same at any length of
        the answer (joining the whole answer each time would make a long answer's checks quadratic)."""
        if not self.stop_strings:
            return False
        tail = (self.committed[-self.stop_reach :] + new).decode("utf-8", "replace")
        return any(s in tail for s in self.stop_strings)


def _copied(draft: Draft, j: int) -> int | None:
    return None if draft.copied_from is None else draft.copied_from + j


# --- the loop --------------------------------------------------------------------------------------------------------


def _prefill(ctx) -> None:
    """Feed the prompt in one forward, as plain tools do: its last position's logits, which choose the first token, are
    kept by the context (`runners.kept.KeptLogits`), so round 0 reads them again without feeding anything again."""
    ctx.forward(keep=1)


class Generation:
    """One answer in progress: the target's context, the sources that draft for it, the schedule, the random
    streams, the counts and the answer."""

    def __init__(
        self,
        pair: Pair,
        prompt_ids,
        drafter_prompt_ids,
        settings: GenerationSettings,
        probe_first: bool,
        memory=None,
    ):
        """`settings` checked, its algorithm runnable on `pair` (`stream`); `memory`: where the suffix source looks up
        earlier answers (`suffix.Scope`; None: the conversation only)."""
        algorithm, k = _algorithm_and_k(settings)
        params, max_new_tokens = SamplingParams.of(settings), settings.max_new_tokens
        self.pair = pair
        # With a seed, auto only uses modes whose answer the seed fixes (plain, slem, lookups: position_generator), so
        # "same seed, same text" holds for regenerate, for --samples, and between the compare view's two columns.
        seeded = not params.greedy and params.seed is not None
        self.schedule = Schedule(  # auto weighs the lookups too: they need nothing loaded
            pair, algorithm, k, probe_first, seeded_sampling=seeded, lookup=True, answer_tokens=max_new_tokens
        )
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        rng = Randomness(make_generator(params.seed, DRAFTER_STREAM), base_seed)
        self.tally = Tally(algorithm, self.schedule.model.step_at_load)
        self.target = pair.target_runner.new_context(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.answer = Answer(pair, max_new_tokens, settings.stop_strings)
        self.rules = Rules(pair, params, rng, self.answer.eos, self.schedule.min_confidence)
        self.start = Start(self.rules, list(prompt_ids), drafter_prompt_ids, self.answer, memory)
        self.sources: dict[Algorithm, Source] = {
            m: start_source(m, self.start) for m in self.schedule.weighed if not m.plain
        }
        """Each mode's source of drafts for this answer (the drafter model's modes share its state)."""
        t0 = time.perf_counter()
        _prefill(self.target)
        self.tally.prompt_s = time.perf_counter() - t0

    def finish(self) -> None:
        """Leave the target's context holding exactly what plain decoding would have fed: the prompt and the answer
        up to the token before the last one emitted (the end of sequence counts), none of the drafts a speculative
        round fed past a stop. What a generation leaves behind is then the same whatever algorithm ran it."""
        emitted = len(self.answer.ids) + (self.answer.stop_reason == "eos")
        self.target.truncate(self.prompt_len + max(0, emitted - 1))

    def stats(self) -> Stats:
        accounts = self.start.accounts
        forward_s = self.target.forward_s + sum(a.forward_s for a in accounts)
        stopped = next((a.stopped for a in accounts if a.stopped), None)
        return self.tally.stats(len(self.answer.ids), self.answer.stop_reason, forward_s, stopped)

    def plan(self) -> tuple[Algorithm, int, int, frozenset[Algorithm]]:
        """(mode, k, the target's room, the modes whose source can propose now) for the next round: the schedule's
        choice among those, fitted to the source's room and the target's."""
        available = frozenset(m for m, source in self.sources.items() if source.available())
        pending = max((source.pending() for source in self.sources.values()), default=0)
        mode, k = self.schedule.next(available, pending=pending, context=len(self.target.ids))
        target_room = room_after(self.pair.context_length, len(self.target.ids))  # the verify positions must fit too
        if not mode.plain:
            k = min(k, self.sources[mode].room(), target_room)
        if k < 1:
            mode, k = PLAIN, 0
        return mode, k, target_room, available

    def step(self) -> Round:
        """Run one round, commit what it emitted, and learn from it."""
        mode, k, target_room, available = self.plan()
        expected = self.schedule.expected_speedup if not mode.plain else None
        t0 = time.perf_counter()
        source = self.sources.get(mode)
        draft, verdict, times = speculative_round(
            self.rules, self.target, source, mode, k, len(self.answer.ids), target_room
        )
        committed = len(self.answer.ids)
        pieces = self.answer.commit(draft, verdict, self.tally.rounds, mode.value if draft.candidates else "")
        for each in self.sources.values():
            each.commit(self.answer.ids[committed:])
        record = self._record(mode, k, draft, verdict, times, time.perf_counter() - t0)
        self.tally.record(record)
        self.schedule.observe(record)
        return Round.of(
            record,
            index=self.tally.rounds - 1,
            pieces=tuple(pieces),
            stats=self.stats(),
            expected_speedup=expected,
            declined=self.schedule.declined if mode.plain else None,
            bound=self.schedule.bound if mode.plain else None,
            sources=self.schedule.sources(mode, available) if self.schedule.algorithm.chooses else (),
        )

    def _record(self, mode, k, draft: Draft, verdict: Verdict, times: RoundTimes, round_s: float) -> RoundRecord:
        context = len(self.target.ids) - 1 - verdict.accepted  # before the round: it committed its emitted tokens
        billed = [a.bill() for a in self.start.accounts]
        return RoundRecord(
            algorithm=mode,
            k=k,
            drafted=len(draft.candidates),
            accepted=verdict.accepted,
            draft_steps=draft.steps,
            draft_s=times.draft_s,
            verify_s=times.verify_s,
            round_s=round_s,
            # the target's forward fed the drafts and the token the last round added; round 0 has none (the
            # prompt's last position came with the prompt)
            fed=len(draft.candidates) + (self.tally.rounds > 0),
            setup_s=sum(s for s, _ in billed),
            setup_tokens=sum(n for _, n in billed),
            context=context,
        )


def stream(
    pair: Pair,
    prompt_ids: list[int],
    drafter_prompt_ids: list[int] | None = None,
    settings: GenerationSettings | None = None,
    *,
    cancel: threading.Event | None = None,
    probe_first: bool = True,
    memory=None,
) -> Iterator[Round | Finished]:
    """Decode from the target with the drafter's help; yield a Round per target forward and a Finished at the end.

    The output is exactly the target's: token-identical to plain greedy decoding when greedy, and distributed as
    plain sampling otherwise. The models are never modified; both stay usable after a cancel.
    `settings` (checked once, where the request came in) say how: the algorithm, the draft length (auto: adapted
    per round), sampling, the answer's length and its stop strings. With `probe_first` the rounds are plain target
    steps until one has measured the single-step time behind c and v: round 0 reads the logits the prompt left
    (nothing to time), round 1 feeds a token.
    `memory`: the scope of this process's earlier answers (`suffix.Scope`) that the suffix source drafts from; the
    answer joins it when the generation ends, whatever algorithm ran (None: nothing is remembered or looked up).
    """
    settings = settings or GenerationSettings()
    resolve_algorithm(pair, settings.algorithm)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    gen = Generation(pair, prompt_ids, drafter_prompt_ids, settings, probe_first, memory)
    try:
        while gen.answer.stop_reason is None:
            if cancel is not None and cancel.is_set():
                gen.answer.stop_reason = "cancelled"
                break
            yield gen.step()
    finally:  # also when the consumer stops early (a client gone): the context is left as plain decoding leaves it
        gen.finish()
        if memory is not None:
            memory.remember(gen.answer.ids)
    text = pair.target_tokenizer.decode(gen.answer.ids, skip_special_tokens=False)
    yield Finished(text=text, target_ids=tuple(gen.answer.ids), stats=gen.stats())
