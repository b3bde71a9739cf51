"""The Gradio app: Pair, Chat and Compare tabs, and the /generate and /compare API endpoints.

It only consumes what `usd` yields: `usd.stream`'s Rounds and Finished, turned into HTML by `render`.
"""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import gradio as gr

from usd import api, suffix, suggest
from usd.algorithms import PLAIN
from usd.chat import check_prompt
from usd.errors import Failed, InternalError
from usd.loading import LoadError
from usd.runners import cpu_threads
from usd.serve.slots import Slots
from usd.settings import ALGORITHMS, DRAFT_TOKENS_MAX, MAX_NEW_TOKENS_MAX, GenerationSettings

from . import render
from .live import Channels
from .pairs import NO_DRAFTER, Pairs
from .space import gpu, runs_elsewhere
from .suggest_ui import rank_section

if TYPE_CHECKING:
    from .v1 import AppService

DRAFT_CHOICES = ["auto"] + [str(k) for k in range(1, DRAFT_TOKENS_MAX + 1)]
DEFAULT = GenerationSettings()
"""The settings' defaults, for the widgets and the API endpoints' signatures."""
STOPPED = " [stopped]"
"""Marks an answer cut short by Stop in the chat; taken off again before the chat goes back to the models."""
MODELS = "models"
"""The concurrency group of every event that runs or loads models."""


@dataclass(frozen=True)
class Pace:
    """The least time between two updates of a generation's views: its live views (token view, stats, chart) and the
    chat's answer bubble. Rounds in between are merged into one update; the first goes out at once, the last as soon
    as the answer ends. Each update costs the browser work, on a CPU machine on the cores the engine decodes on; where
    the engine has a thread on every core, each piece of that work displaces one and the step waits at its barrier.
    Measured in docs/benchmarks.md ("The Chat tab against the engine")."""

    live: float
    chat: float


PACE = Pace(live=0.25, chat=1.0)
"""Live views over the app's own channel (app/live.py), each update costing the page what it shows: a few a second.
The chat's bubble goes through Gradio, whose every message costs the page a fixed amount of work besides the redrawn
answer."""
BUSY_CORES_PACE = Pace(live=0.5, chat=3.0)
"""PACE where the target decodes on this machine's CPU with a thread on every core (`pace`): the token view beside the
chat shows every new piece twice a second, the bubble catches up every few seconds."""
GRADIO_PACE = Pace(live=0.5, chat=1.0)
"""Without a channel (a generation that runs in another process, ZeroGPU): Gradio carries every update."""
BUSY_CORES_GRADIO_PACE = Pace(live=1.0, chat=1.0)
"""GRADIO_PACE where the target decodes on this machine's CPU with a thread on every core."""
LIVE_PARTS = ("head", "tokens", "stats", "chart")
"""A live view's parts, in the order they stand in it; a view has the ones it is built with (`live_view`)."""
LIVE_JS = """
const part = (name) => element.querySelector('.live-' + name);
const box = element.querySelector('.tokens'), head = part('head'), stats = part('stats'), chart = part('chart');
let run = null, shown = 0, rows = [], drawn = -Infinity;
const CHART_MS = 2000;  // the chart, redrawn whole, is drawn at most this often, and on every whole value (the last)
const W = 360, H = 150, L = 34, R = 10, T = 8, B = 20;
const draw = () => {
  if (!chart) return;
  const last = rows.length ? rows[rows.length - 1][0] : 1, first = rows.length ? rows[0][0] : 0;
  const top = rows.reduce((m, r) => Math.max(m, r[1], r[2]), 1);
  const x = (r) => (L + (W - L - R) * (r - first) / Math.max(1, last - first)).toFixed(1);
  const y = (t) => (T + (H - T - B) * (1 - t / top)).toFixed(1);
  const line = (i) => rows.map((r) => x(r[0]) + ',' + y(r[i])).join(' ');
  chart.querySelector('svg').innerHTML =
    `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>` +
    `<line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>` +
    `<text x="${L - 4}" y="${T + 8}" text-anchor="end">${top}</text>` +
    `<text x="${L - 4}" y="${H - B}" text-anchor="end">0</text>` +
    `<text x="${L}" y="${H - 4}">round ${rows.length ? first : ''}</text>` +
    `<text x="${W - R}" y="${H - 4}" text-anchor="end">${rows.length ? last : ''}</text>` +
    `<polyline class="emitted" points="${line(2)}"/><polyline class="accepted" points="${line(1)}"/>`;
};
const apply = (v) => {
  if (!v || typeof v !== 'object' || !v.tokens) return;
  const feed = v.tokens;
  if (feed.run !== run || feed.from === 0) {
    box.replaceChildren(); run = feed.run; shown = 0; rows = []; drawn = -Infinity;
  }
  if (feed.from === shown) { box.insertAdjacentHTML('beforeend', feed.html); shown = feed.to; }
  if (head && v.head !== undefined) head.innerHTML = v.head;
  if (stats && v.stats !== undefined) stats.innerHTML = v.stats;
  if (chart && v.chart && v.chart.from === rows.length) {
    rows.push(...v.chart.rows);
    if (performance.now() - drawn >= CHART_MS) { draw(); drawn = performance.now(); }
  }
};
let source = null, channel = null;
const listen = (url) => {
  if (url === channel) return;
  if (source) source.close();
  source = null;
  channel = url;
  if (!url) return;
  const events = new EventSource(new URL(url, document.baseURI));
  events.onmessage = (e) => { if (channel === url) apply(JSON.parse(e.data)); };
  events.addEventListener('end', () => events.close());
  source = events;
};
const show = () => {
  const v = props.value;
  apply(v);
  listen(v && typeof v === 'object' && v.channel ? v.channel : null);
};
show();
watch('value', show);
"""
"""A live view appends what each update brings (render.LiveFeed): the new pieces to its token box and the new rows to
its chart, which it draws itself (an SVG of two lines) at most every CHART_MS and at the end (a redraw at every
update cost the engine several percent on a 2-core machine); its heading and stats are replaced whole. A value that
names a channel (app/live.py) has it read the updates from there until a value without one, the last, arrives."""


class InputError(ValueError):
    """A setting the user can fix; shown as is."""


KNOBS = ("algorithm", "draft_tokens", "temperature", "top_p", "top_k", "seed", "max_new_tokens")
"""The settings the UI shows, in the order of its widgets (`settings_panel`) and of its handlers' parameters."""


def knobs_of(values: dict) -> tuple:
    """The settings among a handler's parameters (its `locals()`), in KNOBS' order."""
    return tuple(values[name] for name in KNOBS)


def settings(*knobs) -> GenerationSettings:
    """Check the UI's (or an API caller's) settings, which may be any text or JSON; a problem becomes InputError
    with the settings model's message, which says what to change."""
    try:
        return GenerationSettings(**dict(zip(KNOBS, knobs, strict=True)))
    except ValueError as e:
        raise InputError(str(e)) from None


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


def in_background(make_events, cancel: threading.Event, interval: float) -> Iterator[list]:
    """Run the engine's event stream on its own thread and hand over everything it produced since the last batch, at
    most one batch per `interval` (the first event at once, the last as soon as the stream ends): the decode loop never
    waits on Gradio, and the UI's work is bounded by its update rate, not the engine's round rate."""
    q: queue.Queue = queue.Queue()
    end = object()

    def work():
        try:
            for event in make_events():
                q.put(event)
        except Exception as e:  # handed to the consumer, which raises it in the request's own thread
            q.put(Failed(e))
        finally:
            q.put(end)

    worker = threading.Thread(target=work, name="usd-decode", daemon=True)
    worker.start()
    sent = None  # when the last batch went out
    try:
        while True:
            batch = [q.get()]
            while sent is not None and batch[-1] is not end and not isinstance(batch[-1], Failed):
                wait = sent + interval - time.monotonic()
                if wait <= 0:
                    break
                try:
                    batch.append(q.get(timeout=wait))
                except queue.Empty:
                    break
            while not q.empty():
                batch.append(q.get_nowait())
            for item in batch:
                if isinstance(item, Failed):
                    raise item.error
            events = [e for e in batch if e is not end]
            if events:
                sent = time.monotonic()
                yield events
            if len(events) < len(batch):
                return
    finally:
        cancel.set()  # the consumer stopped (done, Stop, a closed tab): make sure the decode loop does too
        worker.join()


def pace(pair, channel: bool) -> Pace:
    """How often the views of a generation on `pair` are updated, over the app's channel or not: the BUSY_CORES pace
    where its target computes on this machine's CPU with a thread on every core, the other elsewhere (a GPU, cores to
    spare, a remote backend)."""
    calm, busy = (PACE, BUSY_CORES_PACE) if channel else (GRADIO_PACE, BUSY_CORES_GRADIO_PACE)
    threads = pair.cpu_threads()
    return busy if threads is not None and threads >= cpu_threads() else calm


@contextlib.contextmanager
def _as_message():
    """What the user can fix (a bad setting or prompt, a pair that will not load) reaches them as a message, not a
    traceback."""
    try:
        yield
    except gr.Error:
        raise
    except (ValueError, LoadError) as e:
        raise gr.Error(str(e), print_exception=False) from None
    except InternalError as e:  # a bug, not the user's input: its traceback goes to the log
        raise gr.Error(f"Internal error, please report it: {e}") from e


def shown_to_user(handler):
    """`handler`, its errors for the user shown as messages (`_as_message`); streaming handlers stay generators,
    and the signature and docstring Gradio reads for the API stay the handler's."""
    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def streaming(*args, **kwargs):
            with _as_message():
                yield from handler(*args, **kwargs)

        return streaming

    @functools.wraps(handler)
    def plain(*args, **kwargs):
        with _as_message():
            return handler(*args, **kwargs)

    return plain


class Every:
    """Due at the first call, then once `seconds` have passed since it was last due, and at the last call."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at: float | None = None

    def due(self, last: bool) -> bool:
        now = time.monotonic()
        if last or self.at is None or now - self.at >= self.seconds:
            self.at = now
            return True
        return False


class Streamed:
    """One live view's values during a generation. With a channel (app/live.py), each update goes over it and Gradio
    keeps the view's first value, which names the channel, until the last, which it carries whole; without one,
    Gradio carries every update."""

    def __init__(self, channels: Channels | None):
        self.channels = channels
        self.channel = channels.open() if channels is not None else None
        self.held: dict | None = None
        self.final: dict | None = None

    def value(self, feed: dict, done: bool) -> tuple[dict, bool]:
        """(the view's value for Gradio, whether Gradio has not had it yet)."""
        if self.final is not None:
            return self.final, False
        if done or self.channel is None:
            if done:
                self.final = feed
                self.end()
            return feed, True
        self.channel.publish(feed)
        if self.held is None:
            self.held = {**feed, "channel": self.channel.url}
            return self.held, True
        return self.held, False

    def end(self) -> None:
        if self.channel is not None:
            self.channels.close(self.channel)


class ChatViews:
    """The chat tab's two outputs for one generation: the chat, and the live view (tokens, stats and chart as one
    component), as updates that cost what changed: the live view gets the new pieces and chart rows, and the chat's
    answer is updated every `chat_s` and at the end.

    With a channel (app/live.py), the live view's updates go over it, and Gradio is sent an update only when the chat
    is due (or the view's first and last value). Without one, the chat, when not due, gets the very value it was last
    sent, which Gradio's stream diff turns into nothing on the wire. Not gr.skip(): Gradio reads a skip as a property
    update, builds the component afresh with its API schema (a few ms of the app's CPU), and then sends the chat's
    next value whole, which the page renders whole."""

    def __init__(self, shown: list, channels: Channels | None = None, chat_s: float = PACE.chat):
        self.shown = shown
        """The chat as the user sees it: the history and the new message."""
        self.live = render.LiveFeed()
        self.view = Streamed(channels)
        self.chat = Every(chat_s)
        self.chat_sent: list = shown

    def update(self, live: render.Live) -> tuple | None:
        """(chat, live view) for the answer so far, or None when Gradio has nothing new to send (the live view's
        update went over its channel, and the chat is not due)."""
        done = live.finished is not None
        chat_due = self.chat.due(done)
        if chat_due:
            answer = render.answer_text(live)
            if live.finished is not None and live.finished.stats.stop_reason == "cancelled":
                answer += STOPPED
            self.chat_sent = [*self.shown, {"role": "assistant", "content": answer}]
        stats = render.stats_html(live.numbers(), live.algorithm)
        view, fresh = self.view.value(self.live.update(live, whole=done, stats=stats), done)
        return (self.chat_sent, view) if chat_due or fresh else None

    def end(self) -> None:
        self.view.end()


def column(live: render.Live | None, label: str, feed: render.LiveFeed) -> dict:
    """One compare column's live view: its tokens (the new ones) and its heading with the numbers so far."""
    label = html.escape(label)
    if live is None:
        return feed.update(None, head=f"<b>{label}</b>: waiting (runs second)")
    n = live.numbers()
    state = "done" if live.finished else "running"
    head = f"<b>{label}</b>: {n['wall_s']:.2f} s · {n['tokens']} tokens · {n['tokens_per_s']:.1f} tok/s ({state})"
    return feed.update(live, whole=live.finished is not None, head=head)


class Handlers:
    """What the app's events and API endpoints run, on the one loaded pair (`Pairs`) and each session's Stop."""

    def __init__(self, pairs: Pairs, slots: Slots | None = None, stream=None, channels: Channels | None = None):
        self.pairs = pairs
        self.cancels = Cancels()
        self.speculative: dict[tuple, tuple[str, float]] = {}
        """pair key -> (algorithm, tokens/s) of the last speculative answer that drafted, for plain answers' panel."""
        self.slots = slots
        """Shared with the app's /v1 routes: generations run at once across the UI and /v1, counted together."""
        self.remote = stream is not None
        self.stream = stream or api.stream
        """`usd.stream`, or the remote backend's stream of the same events (`app.remote`)."""
        self.channels = channels
        """The live views' own update channels (app/live.py); None where the handlers run in another process."""

    # --- shared ----------------------------------------------------------------------------------------------------

    def checked(self, prompt, knobs: tuple, target: str = "", drafter: str = "") -> tuple[str, GenerationSettings]:
        """The prompt and settings every handler starts from, each problem as a message (InputError, LoadError);
        loads the named pair if one is named, and makes sure some pair is loaded."""
        s = settings(*knobs)
        prompt = prompt_text(prompt)
        self.ensure_pair(target, drafter)
        self.pairs.current()
        return prompt, s

    def ensure_pair(self, target: str, drafter: str) -> None:
        if not (target or drafter):
            return
        pairs, loaded = self.pairs, self.pairs.loaded
        t = target or (loaded.target if loaded else pairs.catalog.default.target)
        d = drafter or (loaded.drafter if loaded else pairs.catalog.default.drafter)
        try:
            pairs.load(t, d, log=lambda *_: None)
        except (LoadError, ValueError):
            raise
        except Exception as e:  # whatever a broken model directory throws: the reason, and the old pair stays
            raise LoadError(f"could not load {t} + {d}: {type(e).__name__}: {e}") from None

    def scope(self, request: gr.Request | None) -> str | None:
        """Whose earlier answers the suffix source drafts from (usd/suffix.py): in a Space the visitor's session's
        (none for a call without one), on a local app the chats', shared."""
        if not self.pairs.space_mode:
            return suffix.LOCAL
        return f"session:{request.session_hash}" if request is not None and request.session_hash else None

    def _events(self, pair, s: GenerationSettings, prompt, messages, chat_mode: bool, cancel, scope) -> Iterator:
        # a remote backend keeps its own memory, scoped by its key
        where = {} if self.remote else {"scope": scope}
        events = self.stream(pair, prompt, messages=messages, chat_mode=chat_mode, settings=s, cancel=cancel, **where)
        # what use of a local pair shows refines `usd suggest` (a remote server's pair is not this machine's)
        return events if self.remote else suggest.recording(pair, events, greedy=s.greedy)

    def run(
        self,
        s: GenerationSettings,
        prompt=None,
        *,
        messages=None,
        chat_mode=False,
        cancel=None,
        channel=False,
        scope: str | None = None,
    ) -> Iterator[render.Live]:
        """Stream one generation on the loaded pair as a growing `Live`; engine input errors become InputError.
        `scope`: the suffix memory it drafts from and joins (`scope`; None: none)."""
        pair, key = self.pairs.current(), self.pairs.key()
        live = render.Live(
            s.algorithm,
            baseline_tokens_per_s=self.pairs.baselines.get(key),
            earlier_speculative=self.speculative.get(key),
        )
        cancel = cancel or threading.Event()
        hold = self.slots.hold(cancel) if self.slots else contextlib.nullcontext(True)
        with hold as running:
            if not running:  # stopped while waiting for a slot
                return
            events = in_background(
                lambda: self._events(pair, s, prompt, messages, chat_mode, cancel, scope),
                cancel,
                pace(pair, channel).live,
            )
            try:
                for batch in events:
                    for event in batch:
                        live.add(event)
                    yield live
            except ValueError as e:  # PromptError included: the prompt, the context, an algorithm the pair lacks
                raise InputError(str(e)) from None
        done = live.finished
        if done is not None and done.stats.tokens >= 8:
            if s.algorithm.plain:
                self.pairs.baselines[key] = done.stats.tokens_per_s
            elif done.stats.drafted:
                self.speculative[key] = (s.algorithm, done.stats.tokens_per_s)

    # --- chat ------------------------------------------------------------------------------------------------------

    @staticmethod
    def chat_take(message) -> tuple[str, str]:
        """The message box emptied at once, its text held for `chat_send` (and put back should that fail): the box is
        not among the streaming outputs, which each cost the page work at every update."""
        return "", message

    @shown_to_user
    def chat_send(
        self,
        message,
        history,
        algorithm,
        draft_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        max_new_tokens,
        request: gr.Request,
    ):
        history = list(history or [])
        prompt, s = self.checked(message, knobs_of(locals()))
        messages = [{"role": m["role"], "content": _text(m["content"]).removesuffix(STOPPED)} for m in history]
        messages.append({"role": "user", "content": prompt})
        session = request.session_hash if request else "api"
        cancel = self.cancels.start(session)
        channel = self.channels is not None
        chat_s = pace(self.pairs.current(), channel).chat
        views = ChatViews([*history, {"role": "user", "content": prompt}], self.channels, chat_s)
        try:
            for live in self.run(s, messages=messages, cancel=cancel, channel=channel, scope=self.scope(request)):
                update = views.update(live)
                if update is not None:
                    yield update
        finally:
            views.end()
            self.cancels.end(session, cancel)

    def chat_stop(self, request: gr.Request):
        self.cancels.stop(request.session_hash if request else "api")

    # --- compare ---------------------------------------------------------------------------------------------------

    def compare_stream(
        self, prompt, s: GenerationSettings, channel: bool = False, scope: str | None = None
    ) -> Iterator[tuple]:
        """Plain decoding, then speculative, same prompt and seed; yields (plain, speculative, summary) states. The
        plain answer is not remembered: the speculative one must not draft from the answer it is compared with."""
        if not s.greedy and s.seed is None:
            s = s.replace(seed=random.randrange(1 << 31))  # both columns must share it
        plain = spec = None
        for plain in self.run(s.replace(algorithm=PLAIN, draft_tokens="auto"), prompt, chat_mode=True, channel=channel):
            yield plain, None, None
        for spec in self.run(s, prompt, chat_mode=True, channel=channel, scope=scope):
            yield plain, spec, None
        greedy = s.greedy
        divergence = self._divergence(prompt, plain, spec, greedy)
        summary = render.compare_summary(plain.finished, spec.finished, greedy, divergence)
        yield plain, spec, summary

    def _divergence(self, prompt, plain, spec, greedy: bool):
        """At a greedy difference, ask the target whether its two best tokens were a near-tie there (rounding)."""
        first = render.first_difference(plain.finished.target_ids, spec.finished.target_ids)
        if not greedy or first is None or self.remote:  # a remote backend sends no ids to ask the target about
            return None
        return api.divergence(self.pairs.current(), plain.finished.target_ids, first, prompt, chat_mode=True)

    @shown_to_user
    def compare_ui(
        self, prompt, algorithm, draft_tokens, temperature, top_p, top_k, seed, max_new_tokens, request: gr.Request
    ):
        prompt, s = self.checked(prompt, knobs_of(locals()))
        scope = self.scope(request)
        plain_feed, spec_feed = render.LiveFeed(), render.LiveFeed()
        plain_view, spec_view = Streamed(self.channels), Streamed(self.channels)
        spec_label = f"speculative ({s.algorithm})"
        sent = False
        try:
            for plain, spec, summary in self.compare_stream(prompt, s, self.channels is not None, scope):
                left = column(plain, "plain target", plain_feed)
                left, left_fresh = plain_view.value(left, plain.finished is not None)
                if spec is None:  # waiting: its heading says so, once
                    right, right_fresh = column(None, spec_label, spec_feed), not sent
                else:
                    right = column(spec, spec_label, spec_feed)
                    right, right_fresh = spec_view.value(right, spec.finished is not None)
                if left_fresh or right_fresh or summary:
                    yield left, right, render.summary_html(summary) if summary else ""
                    sent = True
        finally:
            plain_view.end()
            spec_view.end()

    # --- API (named endpoints for gradio_client) -------------------------------------------------------------------

    @shown_to_user
    def generate(
        self,
        prompt: str,
        target: str = "",
        drafter: str = "",
        algorithm: str = DEFAULT.algorithm,
        draft_tokens: str = DEFAULT.draft_tokens,
        temperature: float = DEFAULT.temperature,
        top_p: float = DEFAULT.top_p,
        top_k: int = DEFAULT.top_k,
        seed: int | None = DEFAULT.seed,
        max_new_tokens: int = DEFAULT.max_new_tokens,
    ) -> Iterator[tuple[str, list, dict]]:
        """Chat with the loaded pair (or the named one): streams (text, pieces, stats) as it goes, an update or two a
        second (the rounds in between merged). `pieces` is a list of {text, kind, round}; `stats` holds
        acceptance_rate, tokens_per_round, tokens_per_s, wall_s and more. Empty target/drafter: the loaded pair."""
        prompt, s = self.checked(prompt, knobs_of(locals()), target, drafter)
        for live in self.run(s, prompt, chat_mode=True, scope=self.scope(None)):
            stats = live.numbers()
            if live.finished is not None:  # the engine's own final stats, plus the live-only keys
                stats.update(live.finished.stats.as_dict())
            yield render.answer_text(live), [p.as_dict() for p in live.pieces], stats

    @shown_to_user
    def compare(
        self,
        prompt: str,
        target: str = "",
        drafter: str = "",
        algorithm: str = DEFAULT.algorithm,
        draft_tokens: str = DEFAULT.draft_tokens,
        temperature: float = DEFAULT.temperature,
        top_p: float = DEFAULT.top_p,
        top_k: int = DEFAULT.top_k,
        seed: int | None = DEFAULT.seed,
        max_new_tokens: int = DEFAULT.max_new_tokens,
    ) -> Iterator[tuple[str, str, dict]]:
        """Plain target decoding, then speculative decoding, same prompt and seed. Streams (plain_text,
        speculative_text, summary): the texts so far with an empty summary, and last the final texts with the summary
        (identical, plain_s, speculative_s, speedup). It streams so that a cancel stops it within a round (Gradio
        closes a cancelled generator; a plain function would run both halves to the end)."""
        prompt, s = self.checked(prompt, knobs_of(locals()), target, drafter)
        for plain, spec, summary in self.compare_stream(prompt, s, scope=self.scope(None)):
            yield render.answer_text(plain), render.answer_text(spec) if spec else "", summary or {}

    # --- pair ------------------------------------------------------------------------------------------------------

    def spec_of(self, choice: str, free: str) -> str:
        return (free or "").strip() if (free or "").strip() and not self.pairs.space_mode else choice

    def preview(self, t_choice, d_choice, t_free="", d_free=""):
        return self.pairs.preview(self.spec_of(t_choice, t_free), self.spec_of(d_choice, d_free))

    def load(self, t_choice, d_choice, t_free="", d_free="", progress=gr.Progress(track_tqdm=True)):  # noqa: B008
        pairs = self.pairs
        target, drafter = self.spec_of(t_choice, t_free), self.spec_of(d_choice, d_free)
        progress(0, desc=f"loading {target} + {drafter}")
        try:
            pairs.load(target, drafter, log=lambda msg: progress(None, desc=str(msg)))
        except Exception as e:  # any failure to load leaves the previous pair in place; say why, never a traceback
            gr.Warning(f"Could not load the pair: {e}")
            kept = f" {pairs.describe()}, still usable." if pairs.loaded else ""
            return f"⚠ Could not load `{target}` + `{drafter}`: {e}.{kept}", pairs.describe()
        return f"✔ {pairs.describe()}", pairs.describe()


# --- the page --------------------------------------------------------------------------------------------------------


@dataclass
class Page:
    """The app's Gradio page and what `launch` serves beside it on the same server."""

    demo: gr.Blocks
    live: Channels | None = None
    """The live views' update channel (app/live.py); None where the handlers run in another process."""
    service: AppService | None = None
    """The OpenAI-protocol routes (/v1) on the app's own pairs (app/v1.py); None for a front end to a server."""


def build(pairs: Pairs, slots: Slots | None = None, stream=None) -> Page:
    """The app's page, with its live views' channel."""
    channels = None if runs_elsewhere() else Channels()
    h = Handlers(pairs, slots, stream, channels)
    with gr.Blocks(title="usd-chat") as demo:
        gr.Markdown(
            "# usd-chat · universal speculative decoding\nThe drafter proposes, the target verifies: the "
            "answer is exactly the target's own, with every drafted token shown kept or thrown away."
        )
        header = gr.Markdown(pairs.describe(), elem_id="pair-header")
        chat = _chat_tab()
        compare = _compare_tab()
        _pair_tab(demo, h, header)
        knobs = _settings_panel()
        # Every event that runs the models shares one concurrency group: the queue's limit counts them together.
        for trigger in (chat.send.click, chat.box.submit):
            # No progress shown on the box either: Gradio's loader, once shown there, animated on (detached from the
            # page, a frame at every animation tick) until the answer ended.
            taken = trigger(
                h.chat_take,
                chat.box,
                [chat.box, chat.message],
                api_visibility="private",
                concurrency_limit=None,
                show_progress="hidden",
            )
            answered = taken.success(
                gpu(h.chat_send),
                [chat.message, chat.chatbot, *knobs],
                chat.outputs,
                api_visibility="private",
                concurrency_id=MODELS,
                show_progress="hidden",  # its animation redraws the page all along the answer (the views show progress)
            )
            # a message that could not be answered (a bad setting, a prompt too long) goes back into the box
            answered.failure(
                lambda m: m,
                chat.message,
                chat.box,
                api_visibility="private",
                concurrency_limit=None,
                show_progress="hidden",
            )
        chat.stop.click(h.chat_stop, None, None, concurrency_limit=None, api_visibility="private")
        chat.clear.click(
            lambda: ([], render.LiveFeed.empty(stats=render.stats_html({}, "auto"))),
            None,
            chat.outputs,
            api_visibility="private",
            concurrency_limit=None,
            show_progress="hidden",
        )

        compare.run.click(
            gpu(h.compare_ui),
            [compare.prompt, *knobs],
            compare.outputs,
            api_visibility="private",
            concurrency_id=MODELS,
            show_progress="hidden",
        )
        demo.load(pairs.describe, None, header, api_visibility="private", concurrency_limit=None)

        gr.api(gpu(h.generate), api_name="generate", concurrency_id=MODELS)
        gr.api(gpu(h.compare), api_name="compare", concurrency_id=MODELS)
    return Page(demo, channels)


def _chat_tab() -> SimpleNamespace:
    with gr.Tab("Chat", id="chat"), gr.Row():
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Chat", height=420, elem_id="chatbot")
            # one line that grows: Gradio sends a one-line box on Enter, and Shift+Enter breaks the line
            box = gr.Textbox(
                label="Message",
                placeholder="Ask something, then press Enter or Send (Shift+Enter: a new line)",
                lines=1,
                max_lines=8,
                elem_id="message",
            )
            message = gr.State("")
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="send")
                stop = gr.Button("Stop", variant="stop", elem_id="stop")
                clear = gr.Button("Clear chat", elem_id="clear")
        with gr.Column(scale=2):
            gr.HTML(render.legend_html())
            live = live_view("live", ("tokens", "stats", "chart"), stats=render.stats_html({}, "auto"))
    return SimpleNamespace(
        chatbot=chatbot,
        box=box,
        message=message,
        live=live,
        send=send,
        stop=stop,
        clear=clear,
        outputs=[chatbot, live],
    )


def live_view(elem_id: str, parts: tuple[str, ...], **initial: str) -> gr.HTML:
    """A live view: one component holding `parts` (of LIVE_PARTS' names, which also give their order), which the
    page updates from each update's LiveFeed (LIVE_JS): the token box and the chart appended to, the heading and stats
    replaced. In the chat tab (elem_id "live") the parts' ids are their names (#tokens, #stats, #chart); elsewhere the
    view's id and the part's."""
    prefix = "" if elem_id == "live" else f"{elem_id}-"
    chart = (
        f'<div class="chart-title">{render.CHART_TITLE}</div>'
        f'<div class="chart-legend"><span class="accepted">{render.CHART_ACCEPTED}</span>'
        f'<span class="emitted">{render.CHART_EMITTED}</span></div><svg viewBox="0 0 360 150"></svg>'
    )
    inside = {"head": "", "tokens": '<div class="tokens"></div>', "stats": "", "chart": chart}
    template = "".join(f'<div id="{prefix}{p}" class="live-{p}">{inside[p]}</div>' for p in LIVE_PARTS if p in parts)
    return gr.HTML(render.LiveFeed.empty(**initial), html_template=template, js_on_load=LIVE_JS, elem_id=elem_id)


def _compare_tab() -> SimpleNamespace:
    with gr.Tab("Compare", id="compare"):
        gr.Markdown(
            "Same prompt, same seed: the target alone, then speculative decoding with the settings "
            f"below. Run {render.COMPARE_ORDER}."
        )
        prompt = gr.Textbox(label="Prompt", lines=2, elem_id="compare-prompt")
        run = gr.Button("Compare", variant="primary", elem_id="compare-run")
        with gr.Row():
            plain = live_view("compare-plain", ("head", "tokens"), head="<b>plain target</b>")
            spec = live_view("compare-speculative", ("head", "tokens"), head="<b>speculative</b>")
        summary = gr.HTML("", elem_id="compare-summary")
    return SimpleNamespace(prompt=prompt, run=run, outputs=[plain, spec, summary])


def _pair_tab(demo: gr.Blocks, h: Handlers, header: gr.Markdown) -> None:
    pairs = h.pairs
    names = pairs.allowed  # in Space mode only what the Space serves: offering the rest would only fail on load
    suggested = {
        f"{p.target} ← {p.drafter}: {p.why}": (p.target, p.drafter)
        for p in pairs.catalog.pairs
        if p.target in names and p.drafter in names
    }
    loaded = pairs.loaded or pairs.catalog.default
    with gr.Tab("Pair", id="pair"):
        gr.Markdown(
            "Choose a target and a drafter from any family; the numbers below are known before loading. A drafter "
            "model is optional: `ngram` drafts by looking up the conversation, with any target."
        )
        with gr.Row():
            t_pick = gr.Dropdown(names, value=loaded.target, label="Target")
            d_pick = gr.Dropdown([NO_DRAFTER, *names], value=loaded.drafter, label="Drafter")
        with gr.Row(visible=not pairs.space_mode):
            t_free = gr.Textbox(label="…or a target hub id / local path", placeholder="owner/name or /path")
            d_free = gr.Textbox(label="…or a drafter hub id / local path", placeholder="owner/name or /path")
        if suggested:
            pick = gr.Dropdown(list(suggested), value=None, label="Suggested pairs")
            pick.change(
                lambda k: suggested.get(k, (gr.skip(), gr.skip())), pick, [t_pick, d_pick], api_visibility="private"
            )
        info = gr.Markdown(elem_id="pair-preview")
        load_btn = gr.Button("Load pair", variant="primary", elem_id="load")
        status = gr.Markdown(elem_id="load-status")
        pair_inputs = [t_pick, d_pick, t_free, d_free]
        for c in pair_inputs:
            c.change(h.preview, pair_inputs, info, api_visibility="private", concurrency_limit=None)
        load_btn.click(h.load, pair_inputs, [status, header], api_visibility="private", concurrency_id=MODELS)
        rank_section(h, pair_inputs, status, header, MODELS)
        demo.load(h.preview, pair_inputs, info, api_visibility="private", concurrency_limit=None)


def _settings_panel() -> list:
    """The settings below the tabs (Chat and Compare both use them), in `settings()`'s order."""
    with gr.Accordion("Settings", open=False, elem_id="settings"):
        with gr.Row():
            algorithm = gr.Dropdown(
                list(ALGORITHMS),
                value=DEFAULT.algorithm,
                label="Algorithm",
                elem_id="algorithm",
                info="auto picks per round what is fastest here; none = the target alone",
            )
            draft = gr.Dropdown(DRAFT_CHOICES, value=DEFAULT.draft_tokens, label="Draft tokens (k)")
            max_new = gr.Number(
                DEFAULT.max_new_tokens,
                label="Max new tokens",
                precision=0,
                minimum=1,
                maximum=MAX_NEW_TOKENS_MAX,
                elem_id="max-new-tokens",
            )
        with gr.Row():
            temperature = gr.Slider(0, 2, value=DEFAULT.temperature, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.05, 1, value=DEFAULT.top_p, step=0.05, label="Top-p")
            top_k = gr.Number(DEFAULT.top_k, label="Top-k (0 = off)", precision=0, minimum=0)
            seed = gr.Textbox("", label="Seed (empty = random)", elem_id="seed")
    return [algorithm, draft, temperature, top_p, top_k, seed, max_new]
