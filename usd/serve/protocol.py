"""The OpenAI wire format: requests read into the engine's own terms, the engine's events written back as responses,
chunks and errors. No model work here and no web framework: plain data in, plain data out.

Every sampling and speculation setting is checked by `usd.settings.GenerationSettings` (the ranges and messages the
API, the CLI and the app use); this module only maps OpenAI's names onto it and refuses, by name, what the engine
cannot honour.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ConfigDict, ValidationError

from usd import chat
from usd.events import Finished, Round, Stats
from usd.settings import GenerationSettings, short_repr

# --- errors ----------------------------------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

MAX_BODY_BYTES = 4 << 20
"""The largest request body the server reads (4 MiB; `limits.BodyLimit` refuses more with a 413 before reading it).
The longest prompt any catalog model can take, 131,072 tokens, is under 1 MiB of English and under 4 MiB of CJK text
sent as JSON's \\uXXXX escapes (6 bytes a character)."""


class APIError(Exception):
    """An error as OpenAI sends it: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f" (this one is {size:,} bytes)" if size is not None else ""
    return APIError(
        413,
        f"the request body is over the server's limit of {limit:,} bytes{got}; send a shorter prompt",
        None,
        "request_too_large",
    )


# --- requests --------------------------------------------------------------------------------------------------------


class Speculative(BaseModel):
    """The `speculative` extension: how to speculate, and whether each chunk should carry its pieces."""

    model_config = ConfigDict(extra="forbid")
    algorithm: Any = None
    draft_tokens: Any = None
    pieces: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Request(BaseModel):
    # Extra fields are kept and judged one by one (`refuse_unsupported`): a known one at its no-op value passes, a
    # known one the engine cannot honour and any unknown one get a 400 that names it.
    model_config = ConfigDict(extra="allow")
    model: str
    # the settings stay untyped here: GenerationSettings reads and checks them, with its own messages
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    """Not in OpenAI's API; vLLM's name for it (send it with the client's extra_body)."""
    seed: Any = None
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None
    user: str | None = None
    """Identifies the caller; does not change the answer."""


class ChatRequest(_Request):
    messages: list[Any]
    max_completion_tokens: Any = None


class CompletionRequest(_Request):
    prompt: Any


_TOOLS = "tool and function calling are not supported: the answer is the target's plain text"
_LOGPROBS = "log probabilities are not reported by this server"
_PENALTY = "penalties would change the target's distribution, which speculative decoding reproduces exactly"
UNSUPPORTED: dict[str, tuple[tuple, str | None]] = {
    # field: (values that ask for nothing beyond what the server does, why anything else is refused; None: accepted)
    "n": ((1,), "this server generates one choice per request; send n=1 or leave it out"),
    "best_of": ((1,), "this server generates one choice per request; send best_of=1 or leave it out"),
    "logprobs": ((False, 0), _LOGPROBS),
    "top_logprobs": ((0,), _LOGPROBS),
    "echo": ((False,), "echoing the prompt is not supported"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "presence_penalty": ((0,), _PENALTY),
    "frequency_penalty": ((0,), _PENALTY),
    "repetition_penalty": ((1,), _PENALTY),
    "logit_bias": (({},), "logit bias would change the target's distribution; not supported"),
    "tools": (([],), _TOOLS),
    "tool_choice": (("none",), _TOOLS),
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "parallel_tool_calls": ((True, False), _TOOLS),
    "response_format": (({"type": "text"},), "structured output (response_format) is not supported; only text"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning effort is not supported"),
    "verbosity": ((), "verbosity is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "this server stores nothing; send store=false or leave it out"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
    "metadata": ((), None),  # labels for stored completions: accepted, they change nothing
    "prompt_cache_key": ((), None),  # caller identifiers: accepted, they change nothing
    "safety_identifier": ((), None),
}


def refuse_unsupported(request: _Request) -> None:
    for name, value in (request.model_extra or {}).items():
        if name not in UNSUPPORTED:
            raise bad_request(f"unknown field {short_repr(name)}; this server does not support it", param=name)
        allowed, why = UNSUPPORTED[name]
        if why is not None and value is not None and not any(_same(value, a) for a in allowed):
            raise bad_request(f"{name}={short_repr(value)}: {why}", param=name)
    so = request.stream_options
    if so is not None and so.include_obfuscation:
        raise bad_request(
            "stream_options.include_obfuscation: this server does not pad chunks",
            param="stream_options.include_obfuscation",
        )
    if so is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")


def _same(value, allowed) -> bool:
    if isinstance(value, bool) != isinstance(allowed, bool):
        return False
    return value == allowed


R = TypeVar("R", bound=_Request)


def parse(kind: type[R], body) -> R:
    """The request body as `kind`; a malformed one is a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = kind.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "missing":
            raise bad_request(f"{where} is required", param=where) from None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"unknown field {short_repr(where)}", param=where) from None
        raise bad_request(f"{where}: {first['msg']}", param=where) from None
    refuse_unsupported(request)
    return request


# Which request field each setting comes from (for the error's `param`).
_PARAMS = {"algorithm": "speculative.algorithm", "draft_tokens": "speculative.draft_tokens", "stop_strings": "stop"}


def settings_of(request: _Request) -> GenerationSettings:
    """The request's settings, checked by GenerationSettings; a bad one is a 400 with its message and field."""
    spec = request.speculative or Speculative()
    max_param, max_new = "max_tokens", request.max_tokens
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        if request.max_tokens is not None and request.max_tokens != request.max_completion_tokens:
            raise bad_request(
                f"max_tokens ({short_repr(request.max_tokens)}) and max_completion_tokens "
                f"({short_repr(request.max_completion_tokens)}) differ; send one of them",
                param="max_completion_tokens",
            )
        max_param, max_new = "max_completion_tokens", request.max_completion_tokens
    values = {
        "algorithm": spec.algorithm,
        "draft_tokens": spec.draft_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "max_new_tokens": max_new,
        "stop_strings": request.stop,
    }
    try:
        return GenerationSettings(**values)
    except ValueError as e:
        param = next((n for n, v in values.items() if _fails(n, v)), None)
        where = max_param if param == "max_new_tokens" else _PARAMS.get(param, param) if param is not None else None
        raise bad_request(str(e), param=where) from None


def _fails(name: str, value) -> bool:
    try:
        GenerationSettings(**{name: value})
    except ValueError:
        return True
    return False


def chat_messages(request: ChatRequest) -> list[dict]:
    """OpenAI messages as the engine takes them ({role, content} text); the engine's own check then judges them."""
    out = []
    for i, m in enumerate(request.messages):
        if not isinstance(m, dict):
            raise bad_request(f"message {i} must be an object with 'role' and 'content'", param=f"messages.{i}")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v not in (None, [], ""))
        if extra:
            raise bad_request(
                f"message {i}: {', '.join(map(short_repr, extra))} not supported; send role and text content only",
                param=f"messages.{i}",
            )
        role, content = m.get("role"), m.get("content")
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role in ("tool", "function"):
            raise bad_request(f"message {i} has role {short_repr(role)}: {_TOOLS}", param=f"messages.{i}.role")
        if isinstance(content, list):
            content = "".join(_text_part(i, part) for part in content)
        out.append({"role": role, "content": content})
    try:
        return chat.check_messages(out)
    except chat.PromptError as e:
        raise bad_request(str(e), param="messages") from None


def _text_part(i: int, part) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise bad_request(
        f"message {i} has a {short_repr(kind)} content part; only text is supported", param=f"messages.{i}"
    )


def completion_prompt(request: CompletionRequest) -> str:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        what = "token ids" if prompt and all(isinstance(t, int) for t in prompt) else "a list of prompts"
        raise bad_request(f"prompt must be one text; {what} are not supported", param="prompt")
    try:
        return chat.check_prompt(prompt)
    except chat.PromptError as e:
        raise bad_request(str(e), param="prompt") from None


# --- the engine's stats, as the response's `speculative` ------------------------------------------------------------


@dataclass
class Counts:
    """What one generation's rounds add up to beyond `Stats`: the accepted-draft histogram of the drafting rounds."""

    histogram: list[int] = field(default_factory=list)

    def add(self, event: Round) -> None:
        if event.drafted:
            n = event.accepted
            self.histogram.extend([0] * (n + 1 - len(self.histogram)))
            self.histogram[n] += 1


IN_VLLM_NAMES = {"drafted": "num_draft_tokens", "accepted": "num_accepted_draft_tokens"}
"""Stats fields the response says in vLLM's names (`speculative_stats`)."""
NOT_SENT = ("acceptance_rate", "overhead_share")
"""Stats fields the response leaves out: draft_acceptance_rate says the first, and the second is the app's."""


def speculative_stats(stats: Stats, counts: Counts) -> dict:
    """The engine's numbers for the response. Where vLLM reports the same quantity per request (its experimental
    `metrics.speculative_decoding`), its name is used: num_spec_steps, num_draft_tokens, num_accepted_draft_tokens,
    draft_acceptance_rate, mean_acceptance_length, acceptance_histogram. The rest are the engine's own
    (`Stats.as_dict`)."""
    steps = sum(counts.histogram)
    measured = stats.plain_step_speedup  # against plain steps inside this answer, as the app estimates
    own = {k: v for k, v in stats.as_dict().items() if k not in NOT_SENT}
    return {
        **{IN_VLLM_NAMES.get(k, k): v for k, v in own.items()},
        "num_spec_steps": steps,
        "draft_acceptance_rate": stats.acceptance_rate if stats.drafted else None,
        "mean_acceptance_length": 1 + stats.accepted / steps if steps else None,
        "acceptance_histogram": list(counts.histogram),
        "measured_speedup": measured,
        "speedup_basis": "estimated from this answer's plain steps" if measured is not None else None,
    }


def stats_from_speculative(s: dict) -> Stats:
    """The engine's Stats back from a response's `speculative` (what `speculative_stats` wrote): how the app reads
    usd serve's numbers when it is that server's front end."""
    return Stats(
        algorithm=s.get("algorithm", "auto"),
        rounds=s.get("rounds", 0),
        drafted=s.get("num_draft_tokens", 0),
        accepted=s.get("num_accepted_draft_tokens", 0),
        tokens=s.get("tokens", 0),
        wall_s=s.get("wall_s", 0.0),
        stop_reason=s.get("stop_reason"),
        c=s.get("c"),
        v=s.get("v"),
        mean_k=s.get("mean_k") or 0.0,
        rounds_by_algorithm=s.get("rounds_by_algorithm") or {},
        drafted_by_algorithm=s.get("drafted_by_algorithm") or {},
        accepted_by_algorithm=s.get("accepted_by_algorithm") or {},
        forward_s=s.get("forward_s") or 0.0,
        drafting_stopped=s.get("drafting_stopped"),
        step_s=s.get("step_s"),
        prompt_s=s.get("prompt_s") or 0.0,
    )


def finish_reason(stop_reason: str | None) -> str:
    return "length" if stop_reason == "max_tokens" else "stop"


# --- responses -------------------------------------------------------------------------------------------------------


class StopTrim:
    """OpenAI's answer ends before the first stop string; the engine's ends with the token that completed it. While
    streaming, text that could still be the start of a stop string is held back until it is known not to be.

    Linear in the text: each stop string's matcher (`_Matcher`) follows the text a character at a time, so how much
    to hold back is known without looking back over it, and the first stop string is found with str.find on what is
    held (at most the longest stop string plus the new text)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.matchers = [_Matcher(s) for s in self.stops]
        self.held = ""
        self.done = False

    def feed(self, text: str) -> str:
        if self.done:
            return ""
        if not self.stops:
            return text
        self.held += text
        cut = first_stop(self.held, self.stops)
        if cut >= 0:
            self.done = True
            out, self.held = self.held[:cut], ""
            return out
        keep = max(m.feed(text) for m in self.matchers)  # the longest end of the text that begins a stop string
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out) :]
        return out

    def end(self) -> str:
        out, self.held = ("" if self.done else self.held), ""
        return out


class _Matcher:
    """How many characters of one stop string the text seen so far ends with (Knuth-Morris-Pratt): each character
    moves it in amortised constant time, where trying every prefix against the text's end would cost the square of
    the stop string's length at each step."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fallback = [0] * len(stop)
        """fallback[i]: the longest proper prefix of stop[: i + 1] that is also its suffix."""
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fallback[i] = k
        self.matched = 0

    def feed(self, text: str) -> int:
        stop, fallback, k = self.stop, self.fallback, self.matched
        for ch in text:
            if k == len(stop):  # a whole match (the caller has seen it): go on from its longest border
                k = fallback[k - 1]
            while k and stop[k] != ch:
                k = fallback[k - 1]
            if stop[k] == ch:
                k += 1
        self.matched = k
        return k


def first_stop(text: str, stops: tuple[str, ...]) -> int:
    """Where the first stop string in `text` begins, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def trimmed(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to its first stop string."""
    cut = first_stop(text, stops)
    return text if cut < 0 else text[:cut]


class _StreamedTextChoice(CompletionChoice):
    """A text completion's choice as a stream chunk carries it. OpenAI streams text completions as `Completion`
    objects whose finish_reason is null until the last one, while the SDK's type requires one (its client reads stream
    chunks without validating them): this relaxes that one field, and every other is checked as the SDK's."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class _CompletionChunk(Completion):
    choices: list[_StreamedTextChoice]  # type: ignore[assignment]


def _wire(kind: type[BaseModel], data: dict) -> dict:
    """`data` checked as the `openai` package's type `kind` (a maintained schema: a field of the wrong name, type or
    value fails here, not in a client), as JSON data: the fields given, extensions (`speculative`) included."""
    return kind.model_validate(data).model_dump(mode="json", exclude_unset=True)


@dataclass
class Shape:
    """The response shape of one request: chat or text completion, its id, creation time and model. Responses and
    chunks are the `openai` package's ChatCompletion, ChatCompletionChunk and Completion."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, done: Finished, prompt_tokens: int, spec: dict) -> dict:
        reason = finish_reason(done.stats.stop_reason)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        body = {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage(prompt_tokens, len(done.target_ids)),
            "speculative": spec,
        }
        return _wire(ChatCompletion if self.chat else Completion, body)

    def chunk(
        self, text: str | None = None, reason: str | None = None, role: bool = False, spec: dict | None = None
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if spec is not None:
            out["speculative"] = spec
        return _wire(ChatCompletionChunk if self.chat else _CompletionChunk, out)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
        return _wire(ChatCompletionChunk if self.chat else _CompletionChunk, body)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
