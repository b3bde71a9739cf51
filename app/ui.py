"""The Gradio app: Pair, Chat and Compare tabs, and the /generate and /compare API endpoints.

It only consumes what `usd` yields: `usd.stream`'s Rounds and Finished, turned into HTML by `render`.
"""

from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pandas as pd

from usd import api
from usd.chat import check_prompt
from usd.loading import LoadError

from . import render
from .pairs import Pairs
from .space import gpu

ALGORITHM_CHOICES = ["auto", "tli", "slem", "standard", "none"]
DRAFT_CHOICES = ["auto"] + [str(k) for k in range(1, 17)]
MAX_NEW_TOKENS_LIMIT = 4096
DEFAULTS = {"algorithm": "auto", "draft_tokens": "auto", "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
            "max_new_tokens": 256}  # fmt: skip
CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "app.css"
STOPPED = " [stopped]"
"""Marks an answer cut short by Stop in the chat; taken off again before the chat goes back to the models."""
MODELS = "models"
"""The concurrency group of every event that runs or loads models."""
EMPTY_CHART = None
"""An empty plot starts as None: a plot whose first value is an empty frame never draws its series later."""


class InputError(ValueError):
    """A setting the user can fix; shown as is."""


def settings(algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens) -> dict:
    """Check the UI's (or an API caller's) settings; each problem gets a message saying what to change. API callers
    can send any text or JSON for any setting, so nothing here may assume a type."""
    algorithm = DEFAULTS["algorithm"] if algorithm in (None, "") else str(algorithm).strip()
    if algorithm not in ALGORITHM_CHOICES:
        raise InputError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHM_CHOICES)}")
    draft_tokens = DEFAULTS["draft_tokens"] if draft_tokens in (None, "") else str(draft_tokens).strip()
    if draft_tokens != "auto":
        k = _as_int(draft_tokens)
        if k is None or not 1 <= k <= 16:
            raise InputError(f"draft tokens must be auto or a whole number from 1 to 16, got {draft_tokens!r}")
        draft_tokens = k
    temperature = DEFAULTS["temperature"] if temperature is None else _real(
        temperature, "temperature must be a number from 0 (greedy) to 5", lambda t: 0 <= t <= 5)
    top_p = DEFAULTS["top_p"] if top_p is None else _real(
        top_p, "top-p must be a number above 0 and at most 1", lambda p: 0 < p <= 1)
    top_k = _whole(DEFAULTS["top_k"] if top_k is None else top_k, "top-k", 0, 1 << 20)
    seed = None if seed is None or str(seed).strip() == "" else _whole(seed, "seed", 0, (1 << 63) - 1)
    if max_new_tokens in (None, ""):
        max_new_tokens = DEFAULTS["max_new_tokens"]
    max_new_tokens = _whole(max_new_tokens, "max new tokens", 1, MAX_NEW_TOKENS_LIMIT)
    return {"algorithm": algorithm, "draft_tokens": draft_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "seed": seed, "max_new_tokens": max_new_tokens}  # fmt: skip


def _whole(x, name: str, lo: int, hi: int) -> int:
    n = _as_int(x)
    if n is None or not lo <= n <= hi:
        raise InputError(f"{name} must be a whole number from {lo} to {hi:,}, got {x!r}")
    return n


def _as_int(x) -> int | None:
    """`x` as a whole number, or None when it is not one ("inf", "nan", "²", 2.5, text, a list, True).
    Ints and digit strings convert exactly (a 19-digit seed must not be rounded through a float); whole floats, as
    the number widgets send (64.0), are fine too."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str):
        with contextlib.suppress(ValueError):
            return int(x)
    f = _float(x)
    return int(f) if math.isfinite(f) and f.is_integer() else None


def _real(x, problem: str, ok) -> float:
    """`x` as a float that passes `ok`, else InputError(problem, and what was given)."""
    f = _float(x)
    if not ok(f):  # NaN fails every comparison: text, "nan" and other types all end up here
        raise InputError(f"{problem}, got {x!r}")
    return f


def _float(x) -> float:
    """float(x), or NaN for what is not a number (text, a list, a bool)."""
    if isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def prompt_text(prompt) -> str:
    """The prompt as given to the model: an API caller may send a number or a list, which is not an empty prompt."""
    if prompt is not None and not isinstance(prompt, str):
        kind = "a number" if isinstance(prompt, int | float) else f"a {type(prompt).__name__}"
        raise InputError(f"the prompt must be text, got {kind}")
    try:
        return check_prompt(prompt)
    except ValueError as e:
        raise InputError(str(e)) from None


def _text(content) -> str:
    """A chat message's text, whether Gradio hands it over as a string or as normalised content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text", "")
    if isinstance(content, list):
        return "".join(_text(c) for c in content)
    return ""


class Cancels:
    """One cancel flag per browser session, so Stop ends that session's generation and no other."""

    def __init__(self):
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self, session: str) -> threading.Event:
        with self._lock:
            self._events[session] = ev = threading.Event()
            return ev

    def stop(self, session: str) -> bool:
        with self._lock:
            ev = self._events.get(session)
        if ev is None:
            return False
        ev.set()
        return True

    def end(self, session: str, ev: threading.Event) -> None:
        with self._lock:
            if self._events.get(session) is ev:
                del self._events[session]


def in_background(make_events, cancel: threading.Event) -> Iterator[list]:
    """Run the engine's event stream on its own thread and hand over, at each look, everything it produced since the
    last one. The decode loop never waits on Gradio, and when rounds come faster than updates can be rendered and
    sent (a GPU makes dozens a second, and each update carries the whole token view) they are merged into one update
    instead of queueing up. On this 2-core CPU a round is slower than an update, so it measures the same as stepping
    the engine in the request's thread (64 tokens through /generate: 11.4 s vs 11.7 s, medians of 3)."""
    q: queue.Queue = queue.Queue()
    end = object()

    def work():
        try:
            for event in make_events():
                q.put(event)
        except Exception as e:  # handed to the consumer, which raises it in the request's own thread
            q.put(_Failed(e))
        finally:
            q.put(end)

    worker = threading.Thread(target=work, name="usd-decode", daemon=True)
    worker.start()
    try:
        while True:
            batch = [q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            for item in batch:
                if isinstance(item, _Failed):
                    raise item.error
            events = [e for e in batch if e is not end]
            if events:
                yield events
            if len(events) < len(batch):
                return
    finally:
        cancel.set()  # the consumer stopped (done, Stop, a closed tab): make sure the decode loop does too
        worker.join()


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


def build(pairs: Pairs) -> gr.Blocks:
    cancels = Cancels()

    def run(prompt=None, messages=None, chat_mode=False, cancel=None, **s) -> Iterator[render.Live]:
        """Stream one generation on the loaded pair as a growing `Live`; engine input errors become InputError."""
        pair, key = pairs.current(), pairs.key()
        live = render.Live(s["algorithm"], baseline_tokens_per_s=pairs.baselines.get(key))
        cancel = cancel or threading.Event()
        events = in_background(
            lambda: api.stream(pair, prompt, messages=messages, chat_mode=chat_mode, cancel=cancel, **s), cancel)
        try:
            for batch in events:
                for event in batch:
                    live.add(event)
                yield live
        except ValueError as e:  # PromptError included: the prompt, the context length, an algorithm the pair lacks
            raise InputError(str(e)) from None
        done = live.finished
        if s["algorithm"] == "none" and done is not None and done.stats.tokens >= 8:
            pairs.baselines[key] = done.stats.tokens_per_s

    def views(live: render.Live):
        n = live.numbers()
        return (render.pieces_html(live.pieces), render.stats_html(n, live.algorithm),
                pd.DataFrame(live.chart) if live.chart else EMPTY_CHART)  # fmt: skip

    def ensure_pair(target: str, drafter: str) -> None:
        if not (target or drafter):
            return
        loaded = pairs.loaded
        t = target or (loaded.target if loaded else pairs.catalog.default.target)
        d = drafter or (loaded.drafter if loaded else pairs.catalog.default.drafter)
        try:
            pairs.load(t, d, log=lambda *_: None)
        except (LoadError, ValueError):
            raise
        except Exception as e:  # whatever a broken model directory throws: the reason, and the old pair stays
            raise LoadError(f"could not load {t} + {d}: {type(e).__name__}: {e}") from None

    def checked(prompt, knobs: tuple, target: str = "", drafter: str = "") -> tuple[str, dict]:
        """The prompt and settings every handler starts from, each problem as a message (InputError, LoadError);
        loads the named pair if one is named, and makes sure some pair is loaded."""
        s = settings(*knobs)
        prompt = prompt_text(prompt)
        ensure_pair(target, drafter)
        pairs.current()
        return prompt, s

    # --- chat ------------------------------------------------------------------------------------------------------

    @gpu
    def chat_send(message, history, algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens,
                  request: gr.Request):  # fmt: skip
        history = list(history or [])
        try:
            prompt, s = checked(message, (algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens))
        except (ValueError, LoadError) as e:
            raise gr.Error(str(e), print_exception=False) from None
        messages = [{"role": m["role"], "content": _text(m["content"]).removesuffix(STOPPED)} for m in history]
        messages.append({"role": "user", "content": prompt})
        session = request.session_hash if request else "api"
        cancel = cancels.start(session)
        shown = [*history, {"role": "user", "content": prompt}]
        try:
            for live in run(messages=messages, cancel=cancel, **s):
                answer = render.answer_text(live)
                if live.finished is not None and live.finished.stats.stop_reason == "cancelled":
                    answer += STOPPED
                yield ([*shown, {"role": "assistant", "content": answer}], "", *views(live))
        except (InputError, LoadError) as e:
            raise gr.Error(str(e), print_exception=False) from None
        finally:
            cancels.end(session, cancel)

    def chat_stop(request: gr.Request):
        cancels.stop(request.session_hash if request else "api")

    # --- compare ---------------------------------------------------------------------------------------------------

    def _divergence(prompt, plain, spec, greedy: bool):
        """At a greedy difference, ask the target whether its two best tokens were a near-tie there (rounding)."""
        first = render.first_difference(plain.finished.target_ids, spec.finished.target_ids)
        if not greedy or first is None:
            return None
        return api.divergence(pairs.current(), plain.finished.target_ids, first, prompt, chat_mode=True)

    def compare_stream(prompt, s) -> Iterator[tuple]:
        """Plain decoding, then speculative, same prompt and seed; yields (plain, speculative, summary) states."""
        if s["temperature"] > 0 and s["seed"] is None:
            s = {**s, "seed": random.randrange(1 << 31)}  # both columns must share it
        plain = spec = None
        for plain in run(prompt, chat_mode=True, **{**s, "algorithm": "none", "draft_tokens": "auto"}):
            yield plain, None, None
        for spec in run(prompt, chat_mode=True, **s):
            yield plain, spec, None
        greedy = s["temperature"] == 0
        divergence = _divergence(prompt, plain, spec, greedy)
        summary = render.compare_summary(plain.finished, spec.finished, greedy, divergence)
        yield plain, spec, summary

    def column(live: render.Live | None, label: str) -> tuple[str, str]:
        if live is None:
            return "", f"**{label}**: waiting (runs second)"
        n = live.numbers()
        state = "done" if live.finished else "running"
        return (render.pieces_html(live.pieces),
                f"**{label}**: {n['wall_s']:.2f} s · {n['tokens']} tokens · {n['tokens_per_s']:.1f} tok/s ({state})")

    @gpu
    def compare_ui(prompt, algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens):
        try:
            prompt, s = checked(prompt, (algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens))
            for plain, spec, summary in compare_stream(prompt, s):
                yield (*column(plain, "plain target"), *column(spec, f"speculative ({s['algorithm']})"),
                       render.summary_html(summary) if summary else "")  # fmt: skip
        except (ValueError, LoadError) as e:
            raise gr.Error(str(e), print_exception=False) from None

    # --- API (named endpoints for gradio_client) -------------------------------------------------------------------

    @gpu
    def generate(prompt: str, target: str = "", drafter: str = "", algorithm: str = "auto", draft_tokens: str = "auto",
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 max_new_tokens: int = DEFAULTS["max_new_tokens"]) -> Iterator[tuple[str, list, dict]]:  # fmt: skip
        """Chat with the loaded pair (or the named one): streams (text, pieces, stats) after every round.
        `pieces` is a list of {text, kind, round}; `stats` holds acceptance_rate, tokens_per_round, tokens_per_s,
        wall_s and more. Empty target/drafter: the loaded pair."""
        try:
            knobs = (algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens)
            prompt, s = checked(prompt, knobs, target, drafter)
            for live in run(prompt, chat_mode=True, **s):
                stats = live.numbers()
                if live.finished is not None:  # the engine's own final stats, plus the live-only keys
                    stats.update(live.finished.stats.as_dict())
                yield render.answer_text(live), render.piece_dicts(live.pieces), stats
        except (ValueError, LoadError) as e:
            raise gr.Error(str(e), print_exception=False) from None

    @gpu
    def compare(prompt: str, target: str = "", drafter: str = "", algorithm: str = "auto", draft_tokens: str = "auto",
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                max_new_tokens: int = DEFAULTS["max_new_tokens"]) -> tuple[str, str, dict]:  # fmt: skip
        """Plain target decoding, then speculative decoding, same prompt and seed. Returns (plain_text,
        speculative_text, summary) with summary holding identical, plain_s, speculative_s, speedup."""
        try:
            knobs = (algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens)
            prompt, s = checked(prompt, knobs, target, drafter)
            *_, (plain, spec, summary) = compare_stream(prompt, s)
        except (ValueError, LoadError) as e:
            raise gr.Error(str(e), print_exception=False) from None
        return plain.finished.text, spec.finished.text, summary

    # --- pair ------------------------------------------------------------------------------------------------------

    def spec_of(choice: str, free: str) -> str:
        return (free or "").strip() if (free or "").strip() and not pairs.space_mode else choice

    def preview(t_choice, d_choice, t_free="", d_free=""):
        return pairs.preview(spec_of(t_choice, t_free), spec_of(d_choice, d_free))

    def load(t_choice, d_choice, t_free="", d_free="", progress=gr.Progress(track_tqdm=True)):  # noqa: B008
        target, drafter = spec_of(t_choice, t_free), spec_of(d_choice, d_free)
        progress(0, desc=f"loading {target} + {drafter}")
        try:
            pairs.load(target, drafter, log=lambda msg: progress(None, desc=str(msg)))
        except Exception as e:  # any failure to load leaves the previous pair in place; say why, never a traceback
            gr.Warning(f"Could not load the pair: {e}")
            kept = f" {pairs.describe()}, still usable." if pairs.loaded else ""
            return f"⚠ Could not load `{target}` + `{drafter}`: {e}.{kept}", pairs.describe()
        return f"✔ {pairs.describe()}", pairs.describe()

    names = pairs.allowed  # in Space mode only what the Space serves: offering the rest would only fail on load
    suggested = {f"{p.target} ← {p.drafter}: {p.why}": (p.target, p.drafter) for p in pairs.catalog.pairs
                 if p.target in names and p.drafter in names}  # fmt: skip
    loaded = pairs.loaded or pairs.catalog.default

    with gr.Blocks(title="usd-chat") as demo:
        gr.Markdown("# usd-chat · universal speculative decoding\nThe drafter proposes, the target verifies: the "
                    "answer is exactly the target's own, with every drafted token shown kept or thrown away.")
        header = gr.Markdown(pairs.describe(), elem_id="pair-header")
        with gr.Tab("Chat", id="chat"), gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat", height=420, elem_id="chatbot")
                box = gr.Textbox(label="Message", placeholder="Ask something, then press Enter or Send",
                                 lines=2, elem_id="message")  # fmt: skip
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    clear = gr.Button("Clear chat", elem_id="clear")
            with gr.Column(scale=2):
                gr.HTML(render.legend_html())
                tokens = gr.HTML(render.pieces_html([]), label="Tokens", elem_id="tokens")
                stats = gr.HTML(render.stats_html({}, "auto"), elem_id="stats")
                chart = gr.LinePlot(EMPTY_CHART, x="round", y="tokens", color="series", height=180,
                                    label="Tokens per round: accepted drafts and emitted", elem_id="chart")

        with gr.Tab("Compare", id="compare"):
            gr.Markdown("Same prompt, same seed: the target alone, then speculative decoding with the settings "
                        f"below. Run {render.COMPARE_ORDER}.")  # fmt: skip
            c_prompt = gr.Textbox(label="Prompt", lines=2, elem_id="compare-prompt")
            c_run = gr.Button("Compare", variant="primary", elem_id="compare-run")
            with gr.Row():
                with gr.Column():
                    c_plain_head = gr.Markdown("**plain target**")
                    c_plain = gr.HTML(render.pieces_html([]))
                with gr.Column():
                    c_spec_head = gr.Markdown("**speculative**")
                    c_spec = gr.HTML(render.pieces_html([]))
            c_summary = gr.HTML("", elem_id="compare-summary")

        with gr.Tab("Pair", id="pair"):
            gr.Markdown("Choose a target and a drafter from any family; the numbers below are known before loading.")
            with gr.Row():
                t_pick = gr.Dropdown(names, value=loaded.target, label="Target")
                d_pick = gr.Dropdown(names, value=loaded.drafter, label="Drafter")
            with gr.Row(visible=not pairs.space_mode):
                t_free = gr.Textbox(label="…or a target hub id / local path", placeholder="owner/name or /path")
                d_free = gr.Textbox(label="…or a drafter hub id / local path", placeholder="owner/name or /path")
            if suggested:
                pick = gr.Dropdown(list(suggested), value=None, label="Suggested pairs")
                pick.change(lambda k: suggested.get(k, (gr.skip(), gr.skip())), pick, [t_pick, d_pick],
                            api_visibility="private")  # fmt: skip
            info = gr.Markdown(elem_id="pair-preview")
            load_btn = gr.Button("Load pair", variant="primary", elem_id="load")
            status = gr.Markdown(elem_id="load-status")
            pair_inputs = [t_pick, d_pick, t_free, d_free]
            for c in pair_inputs:
                c.change(preview, pair_inputs, info, api_visibility="private", concurrency_limit=None)
            load_btn.click(load, pair_inputs, [status, header], api_visibility="private",
                           concurrency_id=MODELS)  # fmt: skip
            demo.load(preview, pair_inputs, info, api_visibility="private", concurrency_limit=None)
        # Settings below the tabs: Chat and Compare both use them.
        with gr.Accordion("Settings", open=False, elem_id="settings"):
            with gr.Row():
                algorithm = gr.Dropdown(ALGORITHM_CHOICES, value="auto", label="Algorithm", elem_id="algorithm",
                                        info="auto picks per round what is fastest here; none = the target alone")
                draft = gr.Dropdown(DRAFT_CHOICES, value="auto", label="Draft tokens (k)")
                max_new = gr.Number(DEFAULTS["max_new_tokens"], label="Max new tokens", precision=0, minimum=1,
                                    maximum=MAX_NEW_TOKENS_LIMIT, elem_id="max-new-tokens")  # fmt: skip
            with gr.Row():
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
                top_k = gr.Number(0, label="Top-k (0 = off)", precision=0, minimum=0)
                seed = gr.Textbox("", label="Seed (empty = random)", elem_id="seed")
        knobs = [algorithm, draft, temperature, top_p, top_k, seed, max_new]
        outputs = [chatbot, box, tokens, stats, chart]
        # Every event that runs the models shares one concurrency group: the queue's limit counts them together.
        for trigger in (send.click, box.submit):
            trigger(chat_send, [box, chatbot, *knobs], outputs, api_visibility="private", concurrency_id=MODELS)
        stop.click(chat_stop, None, None, concurrency_limit=None, api_visibility="private")
        clear.click(lambda: ([], "", render.pieces_html([]), render.stats_html({}, "auto"), EMPTY_CHART),
                    None, outputs, api_visibility="private", concurrency_limit=None)  # fmt: skip

        c_run.click(compare_ui, [c_prompt, *knobs], [c_plain, c_plain_head, c_spec, c_spec_head, c_summary],
                    api_visibility="private", concurrency_id=MODELS)  # fmt: skip
        demo.load(pairs.describe, None, header, api_visibility="private", concurrency_limit=None)

        gr.api(generate, api_name="generate", concurrency_id=MODELS)
        gr.api(compare, api_name="compare", concurrency_id=MODELS)
    return demo
