"""What the app's events and API endpoints run (`Handlers`, shared by the tabs), and the checks at its edge: the
settings and the prompt checked once into `GenerationSettings` and text, each problem a message for the user."""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gradio as gr

from usd import api, suffix, suggest
from usd.algorithms import PLAIN
from usd.chat import check_prompt, user_turn
from usd.errors import InternalError
from usd.loading import LoadError
from usd.serve import Slots
from usd.settings import GenerationSettings

from . import render
from .live import Channels
from .pairs import Pairs
from .views import STOPPED, ChatViews, Streamed, column, in_background, pace

if TYPE_CHECKING:
    from .endpoints import Ask

DEFAULT = GenerationSettings()
"""The settings' defaults, for the widgets and the API endpoints' signatures."""
MODELS = "models"
"""The concurrency group of every event that runs or loads models."""
ON_PAGE_LOAD = {"api_visibility": "private", "concurrency_limit": None, "show_progress": "hidden"}
"""How the events run that fill the page as it opens (the loaded pair's line and preview): side by side, and without
a progress indicator, which would only flash: they answer at once."""


class InputError(ValueError):
    """A setting the user can fix; shown as is."""


KNOBS = ("algorithm", "draft_tokens", "temperature", "top_p", "top_k", "seed", "max_new_tokens")
"""The settings the UI shows, in the order of its widgets (`settings_panel`) and of its handlers' parameters."""


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

    def _events(self, pair, s: GenerationSettings, messages: list[dict], cancel, scope) -> Iterator:
        # a remote backend keeps its own memory, scoped by its key
        where = {} if self.remote else {"scope": scope}
        events = self.stream(pair, messages=messages, settings=s, cancel=cancel, **where)
        # what use of a local pair shows refines `usd suggest` (a remote server's pair is not this machine's)
        return events if self.remote else suggest.recording(pair, events, greedy=s.greedy)

    def run(
        self,
        s: GenerationSettings,
        messages: list[dict],
        *,
        cancel=None,
        channel=False,
        scope: str | None = None,
    ) -> Iterator[render.Live]:
        """Stream the loaded pair's answer to `messages` as a growing `Live`; engine input errors become InputError.
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
                lambda: self._events(pair, s, messages, cancel, scope),
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
    def chat_send(self, request: gr.Request, message, history, *knobs):
        """`knobs`: the settings' values, in KNOBS' order (the request first: Gradio passes it by position)."""
        history = list(history or [])
        prompt, s = self.checked(message, knobs)
        messages = [{"role": m["role"], "content": _text(m["content"]).removesuffix(STOPPED)} for m in history]
        messages.append({"role": "user", "content": prompt})
        session = request.session_hash if request else "api"
        cancel = self.cancels.start(session)
        channel = self.channels is not None
        chat_s = pace(self.pairs.current(), channel).chat
        views = ChatViews([*history, {"role": "user", "content": prompt}], self.channels, chat_s)
        try:
            for live in self.run(s, messages, cancel=cancel, channel=channel, scope=self.scope(request)):
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
        asked = user_turn(prompt)
        for plain in self.run(s.replace(algorithm=PLAIN, draft_tokens="auto"), asked, channel=channel):
            yield plain, None, None
        for spec in self.run(s, asked, channel=channel, scope=scope):
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
        return api.divergence(self.pairs.current(), plain.finished.target_ids, first, messages=user_turn(prompt))

    @shown_to_user
    def compare_ui(self, request: gr.Request, prompt, *knobs):
        """`knobs`: the settings' values, in KNOBS' order (as `chat_send`)."""
        prompt, s = self.checked(prompt, knobs)
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
    def generate(self, ask: Ask) -> Iterator[tuple[str, list, dict]]:
        """Chat with the loaded pair (or the named one): streams (text, pieces, stats) as it goes, an update or two a
        second (the rounds in between merged). `pieces` is a list of {text, kind, round}; `stats` holds
        acceptance_rate, tokens_per_round, tokens_per_s, wall_s and more. Empty target/drafter: the loaded pair."""
        prompt, s = self.checked(ask.prompt, ask.knobs, ask.target, ask.drafter)
        for live in self.run(s, user_turn(prompt), scope=self.scope(None)):
            stats = live.numbers()
            if live.finished is not None:  # the engine's own final stats, plus the live-only keys
                stats.update(live.finished.stats.as_dict())
            yield render.answer_text(live), [p.as_dict() for p in live.pieces], stats

    @shown_to_user
    def compare(self, ask: Ask) -> Iterator[tuple[str, str, dict]]:
        """Plain target decoding, then speculative decoding, same prompt and seed. Streams (plain_text,
        speculative_text, summary): the texts so far with an empty summary, and last the final texts with the summary
        (identical, plain_s, speculative_s, speedup). It streams so that a cancel stops it within a round (Gradio
        closes a cancelled generator; a plain function would run both halves to the end)."""
        prompt, s = self.checked(ask.prompt, ask.knobs, ask.target, ask.drafter)
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
