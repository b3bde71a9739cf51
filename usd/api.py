"""The Python API: load a pair, stream a generation's events, or generate and take the result.

import usd
pair = usd.load_pair("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
for event in usd.stream(pair, "def fibonacci(n):", max_new_tokens=64):
    ...  # a Round per target forward, then a Finished
done = usd.generate(pair, messages=[{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1)
print(done.text, done.stats.acceptance_rate)
creative = usd.GenerationSettings(temperature=0.9, top_p=0.95)  # checked once, reused
done = usd.generate(pair, "Once upon a time", settings=creative, seed=2)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from . import chat, costs, decoder, numerics, suffix
from .catalog import Catalog, Precision, load_catalog
from .events import Finished, Round
from .loading import entry_for, load_model
from .pair import Pair, model_context_length
from .settings import GenerationSettings
from .store import cache_dir


def load_pair(
    target: str | None = None,
    drafter: str | Literal[False] | None = None,
    *,
    catalog: Catalog | None = None,
    device: str | None = None,
    precision: Precision | None = None,
    drafter_precision: Precision | None = None,
    log=print,
) -> Pair:
    """Load a target and a drafter (catalog names, local directories or hub ids; None = the catalog's default pair,
    `drafter=False` = no drafter). Each is fetched and verified first if needed; raises LoadError with the reason."""
    catalog = catalog or load_catalog()
    target = target or catalog.default.target
    if drafter is None:
        drafter = catalog.default.drafter
    t_entry = entry_for(target, catalog)
    t = load_model(t_entry, device=device, precision=precision, catalog=catalog, log=log)
    d = None
    if drafter:
        d = load_model(
            entry_for(drafter, catalog),
            device=device,
            precision=drafter_precision or precision,
            catalog=catalog,
            log=log,
        )
    limits = [n for n in (model_context_length(t.model), t_entry.context_length) if n]
    pair = Pair(
        t.model,
        t.tokenizer,
        d.model if d else None,
        d.tokenizer if d else None,
        target_name=t.name,
        drafter_name=d.name if d else None,
        context_length=min(limits) if limits else None,
        target_runner=t.runner,
        drafter_runner=d.runner if d else None,
    )
    # the target's vocabulary read now, not in a server's first request or a chat's first answer: reading it holds
    # the interpreter a second
    _token_limits(pair)
    pair.tokenizer_key  # noqa: B018 (what the suffix source's memory is kept under, computed once)
    if d:  # what auto's bound needs before its first round (usd/costs.py)
        pair.memory.costs = costs.costs_for(pair, cache_dir(), log)
        costs.restore_learned(pair, cache_dir())
    return pair


def stream(
    pair: Pair,
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    settings: GenerationSettings | None = None,
    cancel: threading.Event | None = None,
    scope: str | None = suffix.LOCAL,
    **options,
) -> Iterator[Round | Finished]:
    """Yield a Round per target forward, then a Finished. A raw `prompt` is continued as text; `messages` is a
    conversation ([{role, content}], the last one the user's; `chat.user_turn(prompt)` asks a chat model one prompt).
    How to generate: `settings`, and/or its fields as keywords (algorithm, draft_tokens, temperature, top_p, top_k,
    seed, max_new_tokens, stop_strings, drafter_rendering), which override it; defaults and ranges are
    GenerationSettings'.
    Bad input raises ValueError (PromptError for the prompt) before any model work, with what to change.
    `scope`: whose earlier answers the suffix source may draft from, and where this answer is remembered (this
    process's `suffix.MEMORY`: a visitor's session in a Space, an API key on a keyed server; None: nowhere).
    It only yields: what a caller wants remembered of the generation (`suggest.recording`, which the app, the CLI
    and the server attach) is the caller's to attach."""
    s = settings or GenerationSettings()
    if options:
        s = s.replace(**options)
    rendering = chat.choose_rendering(pair.memory, s.drafter_rendering)
    check_size(pair, prompt, messages)
    t_ids, d_ids = chat.prompt_ids(pair, prompt, messages, rendering)
    check_context(pair, len(t_ids), s.max_new_tokens)
    memory = suffix.MEMORY.scope(pair.tokenizer_key, scope) if scope is not None else None
    events = decoder.stream(pair, t_ids, d_ids, s, cancel=cancel, memory=memory)
    for event in events:
        if isinstance(event, Finished) and messages is not None and pair.drafter is not None:
            chat.record_rendering(pair.memory, rendering, event.stats.accepted, event.stats.drafted)
        yield event


class ContextLengthError(chat.PromptError):
    """The prompt, or the prompt plus max new tokens, does not fit the target's context."""


def check_context(pair: Pair, prompt_tokens: int, max_new_tokens: int) -> None:
    """`stream`'s context check, on its own: raises ContextLengthError, saying what to change, when a prompt of
    `prompt_tokens` target tokens plus `max_new_tokens` does not fit the target's context (the server checks this
    before a request queues)."""
    limit = pair.context_length
    if limit and prompt_tokens + max_new_tokens > limit:
        if prompt_tokens >= limit:
            raise ContextLengthError(
                f"the prompt is {prompt_tokens:,} tokens, longer than {pair.target_name}'s "
                f"context of {limit:,} tokens; shorten it or start a new chat"
            )
        raise ContextLengthError(
            f"the prompt ({prompt_tokens:,} tokens) plus max new tokens ({max_new_tokens:,}) "
            f"exceeds {pair.target_name}'s context of {limit:,} tokens; lower max new tokens to "
            f"at most {limit - prompt_tokens:,} or shorten the prompt"
        )


def count_prompt(
    pair: Pair, settings: GenerationSettings, prompt: str | None = None, messages: list[dict] | None = None
) -> int:
    """The target tokens of a prompt (or conversation), checked against the context with `settings.max_new_tokens`
    as `check_context` does, and first as `check_size` does. A long prompt that passes check_size waits for one of
    few turns to be tokenized (`_LONG_PROMPTS`); a short one never waits."""
    size = check_size(pair, prompt, messages)
    with _LONG_PROMPTS if size > _LONG_PROMPT_BYTES else contextlib.nullcontext():
        n = len(chat.target_ids(pair, prompt, messages))
    check_context(pair, n, settings.max_new_tokens)
    return n


_LONG_PROMPT_BYTES = 1 << 16
_LONG_PROMPTS = threading.BoundedSemaphore(2)
"""Long prompts are tokenized two at a time: a long one costs the tokenizer much time and memory (it keeps offsets and
strings per token), and ten at once stalled everything else."""


def check_size(pair: Pair, prompt: str | None = None, messages: list[dict] | None = None) -> int:
    """Refuse a text too long for the context before it is tokenized (ContextLengthError), from two lower bounds on
    its tokens that cost one pass over its bytes (a 4 MB prompt would take seconds and gigabytes to tokenize): no
    token holds more ASCII letters and digits than the vocabulary's richest in them (normalizers do not remove ASCII
    letters), and none more bytes than its longest, once the normalizer has had its way (Unicode composition, NFC or
    NFKC, shortens a text at most threefold: Hangul jamo). Returns the text's size in bytes."""
    data = b"".join(text.encode() for text in _texts(prompt, messages))
    if not pair.context_length:
        return len(data)
    limits = _token_limits(pair)
    by_letters = -(-len(data.translate(None, _NOT_ASCII_ALNUM)) // limits.ascii_alnum)
    by_bytes = len(data) // (_NORMALIZED_SHRINKS_AT_MOST * limits.bytes)
    tokens_at_least = max(by_letters, by_bytes)
    if tokens_at_least >= pair.context_length:
        raise ContextLengthError(
            f"the prompt is {len(data):,} bytes, at least {tokens_at_least:,} tokens: longer than {pair.target_name}'s "
            f"context of {pair.context_length:,} tokens; shorten it or start a new chat"
        )
    return len(data)


_NORMALIZED_SHRINKS_AT_MOST = 3
_NOT_ASCII_ALNUM = bytes(b for b in range(256) if not (chr(b).isascii() and chr(b).isalnum()))
"""`bytes.translate(None, _NOT_ASCII_ALNUM)` keeps a text's ASCII letters and digits."""


def _texts(prompt: str | None, messages: list[dict] | None) -> list[str]:
    """A prompt's text, or a conversation's contents, checked."""
    if messages is None:
        return [chat.check_prompt(prompt)]
    return [m["content"] for m in chat.check_messages(messages)]


@dataclass(frozen=True)
class _TokenLimits:
    bytes: int
    """The most bytes one token stands for."""
    ascii_alnum: int
    """The most ASCII letters and digits one token holds."""


_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> its _TokenLimits, computed once (a pass over a vocabulary of 150k tokens)."""
_LIMITS_LOCK = threading.Lock()
"""One thread reads the vocabulary: ten requests arriving at once each reading it would hold the interpreter for
seconds between them (and stall the server's event loop)."""


def _token_limits(pair: Pair) -> _TokenLimits:
    with _LIMITS_LOCK:
        tokenizer = pair.target_tokenizer
        if tokenizer not in _LIMITS:
            tb = pair.target_bytes
            spelled = [*tb.bytes_of.values(), *(s.encode() for s in tb.specials.values())]
            _LIMITS[tokenizer] = _TokenLimits(
                bytes=max(map(len, spelled), default=1),
                ascii_alnum=max(max((len(b.translate(None, _NOT_ASCII_ALNUM)) for b in spelled), default=1), 1),
            )
        return _LIMITS[tokenizer]


def generate(pair: Pair, prompt: str | None = None, **kwargs) -> Finished:
    """Run a whole generation; return the Finished event (text, target_ids, stats). Same arguments as `stream`."""
    done = None
    for event in stream(pair, prompt, **kwargs):
        done = event
    assert isinstance(done, Finished)  # stream ends with its Finished
    return done


def divergence(
    pair: Pair,
    answer_ids,
    position: int,
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
) -> numerics.Divergence:
    """Where two greedy answers to one prompt first differ at `position`: was it a near-tie of the target's two best
    tokens (rounding can swap them) or a real difference? `answer_ids` is either answer; the prompt as for `stream`."""
    t_ids, _ = chat.prompt_ids(pair, prompt, messages)
    return numerics.divergence(pair, t_ids, list(answer_ids), position)
