"""The app as a front end for any OpenAI-compatible server (`python -m app --backend URL`): chat and compare stream
from the server instead of a local pair.

The server's stream is turned into the engine's own events (`Round`, `Finished`), so the UI renders it unchanged.
From `usd serve`, each chunk carries its round's pieces and the stats so far (the `speculative` extension), so the
token view and the stats panel are exactly the local ones. From any other server, each chunk becomes one plain piece,
and the stats are what it reports: the token count (usage) and, from vLLM with per-request metrics on, its
`metrics.speculative_decoding` (drafted, accepted, verification steps)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from usd.catalog import Catalog
from usd.events import Finished, Piece, Round, Stats
from usd.loading import LoadError
from usd.serve import stats_from_speculative
from usd.settings import GenerationSettings

from .pairs import Choice


@dataclass
class RemoteModel:
    """What a remote 'pair' is: a model id on a server, and whether the server is `usd serve`."""

    client: object
    model: str
    drafter: str | None
    usd: bool

    def fills_cpu(self) -> bool:
        """The server computes, not this machine's CPU."""
        return False


class RemotePairs:
    """The `Pairs` the UI uses, backed by a server: its models are what the Pair tab offers; the server decides each
    model's drafter."""

    space_mode = False

    def __init__(self, base_url: str, api_key: str | None, catalog: Catalog):
        from openai import OpenAI

        self.url = base_url
        self.catalog = catalog
        self.client = OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0)
        self.baselines: dict[tuple, float] = {}
        self.pair: RemoteModel | None = None
        self.loaded: Choice | None = None
        self.models: dict[str, dict] = {}
        self.allowed: list[str] = []

    def connect(self) -> None:
        """Ask the server what it serves and pick its first model."""
        import openai

        try:
            listed = self.client.models.list().data
        except openai.APIError as e:
            raise LoadError(f"cannot list the models of {self.url}: {_message(e)}") from None
        if not listed:
            raise LoadError(f"{self.url} serves no models")
        self.models = {m.id: (m.model_extra or {}) | {"owned_by": m.owned_by} for m in listed}
        drafters = [d for d in (info.get("drafter") for info in self.models.values()) if d and d not in self.models]
        self.allowed = [*self.models, *dict.fromkeys(drafters)]
        self._use(listed[0].id)

    def _use(self, model: str) -> None:
        info = self.models[model]
        drafter = info.get("drafter")
        self.pair = RemoteModel(self.client, model, drafter, info.get("owned_by") == "usd-chat")
        self.loaded = Choice(model, drafter or "(the server's)")

    def load(self, target: str, drafter: str, log=print):
        if not self.models:
            self.connect()
        target, drafter = (target or "").strip(), (drafter or "").strip()
        if target not in self.models:
            raise LoadError(f"{self.url} does not serve {target!r}; it serves {', '.join(self.models)}")
        server_drafter = self.models[target].get("drafter")
        if drafter and server_drafter and drafter != server_drafter:
            raise LoadError(f"{self.url} decides the drafter: {target} runs with {server_drafter}")
        self._use(target)
        return self.pair

    def current(self) -> RemoteModel:
        if self.pair is None:
            self.connect()
        return self.pair

    def preview(self, target: str, drafter: str) -> str:
        return (
            f"Served by `{self.url}`: the server loads its models and decides each one's drafter "
            f"(`{target}` runs with `{self.models.get(target, {}).get('drafter') or 'its own'}`)."
        )

    def describe(self) -> str:
        if self.loaded is None:
            return f"Backend `{self.url}`: not reached yet."
        return f"Backend `{self.url}`: target `{self.loaded.target}` · drafter `{self.loaded.drafter}`"

    def key(self) -> tuple:
        return ("remote", self.url, self.loaded.target if self.loaded else "")


def _message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(getattr(e, "message", e))


def stream(
    model: RemoteModel,
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    settings: GenerationSettings,
    cancel=None,
):
    """`usd.stream`'s events, from the server. Settings the server cannot be told are refused, not ignored."""
    import openai

    s = settings
    extra: dict = {}
    if model.usd:
        extra["speculative"] = {"algorithm": s.algorithm, "draft_tokens": s.draft_tokens, "pieces": True}
    elif not s.algorithm.chooses or s.draft_tokens != "auto":
        raise ValueError(
            "this backend decides how it speculates: algorithm and draft tokens (and Compare, which "
            "runs algorithm none) apply to a `usd serve` backend only; use auto"
        )
    if s.top_k:
        extra["top_k"] = s.top_k  # usd serve and vLLM take it; a server that does not will say so
    args = {
        "model": model.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed,
        "stop": list(s.stop_strings) or None,
        "extra_body": extra or None,
    }
    started = time.perf_counter()
    live = _Remote(started)
    try:
        with _create(model, messages, prompt, args) as response:
            for chunk in response:
                if cancel is not None and cancel.is_set():
                    live.stop_reason = "cancelled"
                    break  # leaving the with-block closes the connection, which cancels the server's generation
                event = live.add(chunk, chat=messages is not None)
                if event is not None:
                    yield event
    except openai.APIStatusError as e:
        raise ValueError(f"the backend refused: {_message(e)}") from None
    except openai.APIConnectionError as e:
        raise LoadError(f"cannot reach the backend {model.client.base_url}: {e}") from None
    if live.stop_reason is None:  # no finish reason: the server ended the stream itself
        raise ValueError(_broken_off(model, messages, prompt, args, live))
    yield Finished(text=live.text, target_ids=(), stats=live.stats())


def _create(model: RemoteModel, messages: list[dict] | None, prompt: str | None, args: dict):
    if messages is not None:
        return model.client.chat.completions.create(messages=messages, **args)
    return model.client.completions.create(prompt=prompt, **args)


def _broken_off(model: RemoteModel, messages, prompt, args: dict, live: _Remote) -> str:
    """Why a stream ended without a finish reason, in words. A server may refuse a request only once its stream has
    begun: llama-cpp-python's answers a prompt longer than its context with an empty stream of status 200. The same
    request unstreamed, for one token, then gets the refusal itself (on a new connection if need be: that server
    drops the one its stream was on)."""
    import openai

    if live.text:
        return (
            f"the backend's stream broke off after {live.rounds} pieces, without a finish reason; the server's own "
            "log says why"
        )
    once = {k: v for k, v in args.items() if k != "stream_options"} | {"stream": False, "max_tokens": 1}
    retrying = RemoteModel(model.client.with_options(max_retries=1), model.model, model.drafter, model.usd)
    try:
        _create(retrying, messages, prompt, once)
    except openai.APIStatusError as e:
        return f"the backend refused: {_message(e)}"
    except openai.APIConnectionError as e:
        return f"the backend's stream ended empty, and asking again failed: {e}"
    return "the backend's stream ended empty, without a finish reason; the server's own log says why"


ROUND_KEYS = ("pieces", "round", "k", "expected_speedup", "algorithm", "declined")
"""What a `usd serve` chunk says of its round (the rest of its `speculative` object is the running statistics)."""


def _declined(value) -> tuple[str, int, float] | None:
    """A round's `declined` as the server sent it (a JSON list), or None when it is missing or malformed."""
    try:
        algorithm, k, speedup = value
        return str(algorithm), int(k), float(speedup)
    except (TypeError, ValueError):
        return None


class _Remote:
    """The running state of one remote answer."""

    def __init__(self, started: float):
        self.started = started
        self.text = ""
        self.rounds = 0
        self.tokens: int | None = None
        self.spec: dict | None = None
        self.vllm: dict | None = None
        self.stop_reason: str | None = None

    def add(self, chunk, chat: bool) -> Round | None:
        extra = chunk.model_extra or {}
        if chunk.usage is not None:
            self.tokens = chunk.usage.completion_tokens
        metrics = extra.get("metrics")
        if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
            self.vllm = metrics["speculative_decoding"]
        spec = extra.get("speculative")
        if isinstance(spec, dict):
            self.spec = {k: v for k, v in spec.items() if k not in ROUND_KEYS}
        text, reason = "", None
        if chunk.choices:
            choice = chunk.choices[0]
            text = (choice.delta.content if chat else choice.text) or ""
            reason = choice.finish_reason
        self.text += text
        if reason is not None and self.stop_reason is None:
            self.stop_reason = (self.spec or {}).get("stop_reason") or ("max_tokens" if reason == "length" else "eos")
        if isinstance(spec, dict) and "pieces" in spec:
            self.rounds = int(spec.get("round", self.rounds + 1))
            pieces = tuple(Piece.from_dict(p) for p in spec["pieces"])
            drafted = sum(p.kind in ("accepted", "rejected") for p in pieces)
            accepted = sum(p.kind == "accepted" for p in pieces)
            return Round(
                index=self.rounds,
                k=int(spec.get("k") or 0),
                pieces=pieces,
                drafted=drafted,
                accepted=accepted,
                draft_s=0.0,
                verify_s=0.0,
                other_s=0.0,
                stats=self.stats(),
                expected_speedup=spec.get("expected_speedup"),
                algorithm=str(spec.get("algorithm") or ""),
                declined=_declined(spec.get("declined")),
            )
        if not text:
            return None
        self.rounds += 1
        piece = Piece(text=text, kind="target", target_id=None, round=self.rounds)
        return Round(
            index=self.rounds,
            k=0,
            pieces=(piece,),
            drafted=0,
            accepted=0,
            draft_s=0.0,
            verify_s=0.0,
            other_s=0.0,
            stats=self.stats(),
        )

    def stats(self) -> Stats:
        if self.spec:  # usd serve: the engine's own numbers
            stats = stats_from_speculative(self.spec)
            return replace(stats, stop_reason="cancelled") if self.stop_reason == "cancelled" else stats
        tokens = self.tokens if self.tokens is not None else self.rounds
        v = self.vllm or {}
        return Stats(
            algorithm="server",
            rounds=v.get("num_spec_steps") or self.rounds,
            drafted=v.get("num_draft_tokens", 0),
            accepted=v.get("num_accepted_draft_tokens", 0),
            tokens=tokens,
            wall_s=time.perf_counter() - self.started,
            stop_reason=self.stop_reason,
            c=None,
            v=None,
            mean_k=v.get("num_spec_tokens") or 0.0,
            unreported=self.unreported(),
        )

    def unreported(self) -> tuple[str, ...]:
        """The stats panel's numbers this server did not send (as `Stats.unreported` keys). No server but usd serve
        reports the costs c and v, so nothing derived from them either."""
        drafts = () if self.vllm and "num_draft_tokens" in self.vllm else ("acceptance_rate", "tokens_per_round")
        usage = () if self.tokens is not None else ("tokens",)
        return (*drafts, "k", "c", "v", "theoretical_speedup", "expected_speedup", "measured_speedup", *usage)
