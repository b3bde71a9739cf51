"""Which drafter for this target? Measure every candidate cheaply on this machine and rank them by the speedup the
cost model expects (docs/design.md, "auto: a cost model"):

    S(k) = tau(alpha, k) / (k c + v(k)),  at the best k in 1..K_MAX;  plain decoding is S = 1

with alpha each algorithm's acceptance on the pair, c the drafter's step time over the target's (timed interleaved,
on this machine and runner) and v(k) the target's forward over k + 1 positions over a single step (timed once per
target and machine).

Measuring is cheap: the target runs once per prompt (its greedy answer is the reference), and each drafter then only
*replays* the decode loop along that answer, without the target. Under greedy decoding the committed text at every
position is the target's own answer whatever was drafted, so the replay (the engine's own `propose`, `Answer.commit`
and drafter resync, `DrafterState.follow`) makes exactly the drafts, and the same accept decisions, that
`usd generate --algorithm A --draft-tokens 1` makes: its acceptance is the real one, at one drafter forward per
drafted token and no target forward. (One drafter pass over the whole answer in one tokenization would not be: the
loop's drafter keeps its earlier tokens and its own accepted drafts, re-tokenizing only a tail, and a different
tokenization of the same text can change its argmax.) k = 1 makes accepted / drafted the per-position alpha the
cost model's tau assumes. Under sampling, tli's expected acceptance at a position is sum_x min(p(x), q(x)); it is
reported along the same greedy answer at temperature 1.

What was measured is cached per (target, drafter, prompt set, machine) in `cache_dir()/suggest.json`, and real use
(`usd.stream` and `usd bench`, through `recording`) adds every generation's accepted and tested positions per pair and
algorithm, so the ranking rests on more tokens the more the pairs are used. Use runs at any k; what it adds is counted
per tested position, as auto's cost model counts it (`schedule.CostModel.observe`): the candidates after a round's
first rejection were never tested, so accepted / tested is the per-position alpha at any k, while accepted / drafted
at k > 1 would fall with k (about (tau - 1) / k) and drag a pair's alpha down the longer its drafts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import theory
from .algorithms import DRAFTING, Proposal
from .catalog import add_pair_arguments
from .costs import machine, timed_forward
from .datasets import Prompt
from .drafters import target_proposal
from .runners import runner_for
from .schedule import K_MAX, tested_positions

if TYPE_CHECKING:
    from .catalog import Precision

ALGORITHMS: tuple[str, ...] = tuple(a.value for a in DRAFTING)
"""The algorithms a drafter is measured under (those that draft with a drafter model)."""
ANSWER_TOKENS = 32
"""Answer tokens per prompt the target writes for the reference."""
REPEATS = 7
"""Interleaved timing repeats. Each time is the fastest of its repeats: other work on a shared machine only ever
adds time (as cpu_kernels times its backends)."""
SAMPLED_TEMPERATURE = 1.0

PROMPT_SETS: dict[str, tuple[Prompt, ...]] = {
    "code": (
        Prompt("code/fibonacci", prompt="def fibonacci(n):\n"),
        Prompt("code/is_prime", prompt='def is_prime(n: int) -> bool:\n    """Return True if n is prime."""\n'),
        Prompt("code/reverse", prompt="# Reverse the words of a sentence\ndef reverse_words(sentence):\n"),
        Prompt("code/stack", prompt="class Stack:\n    def __init__(self):\n"),
        Prompt("code/read_csv", prompt="import csv\n\n\ndef read_rows(path):\n"),
    ),
    "chat": tuple(
        Prompt(f"chat/{i}", messages=({"role": "user", "content": text},))
        for i, text in enumerate(
            [
                "Explain recursion in one paragraph.",
                "Write a Python function that reverses a string.",
                "What is the difference between a list and a tuple in Python?",
                "Give three tips for writing readable code.",
                "How does a hash table work?",
            ]
        )
    ),
}


# --- the ranking: numbers in, ordered rows out ------------------------------------------------------------------------


@dataclass
class Acceptance:
    accepted: int = 0
    drafted: int = 0
    """Measured here (the replay along the target's answers)."""
    used_accepted: int = 0
    used_tested: int = 0
    """From real use of the pair (chats, `usd generate`, `usd bench`), greedy runs only: accepted, and tested
    positions (each round's drafted tokens up to and including its first rejected one; at k = 1, every one)."""
    sampled: float | None = None
    """tli/standard: expected acceptance under sampling at temperature 1 (mean of sum min(p, q))."""

    @property
    def alpha(self) -> float | None:
        n = self.drafted + self.used_tested
        return (self.accepted + self.used_accepted) / n if n else None


@dataclass
class Measured:
    """What was measured for one drafter against one target: the inputs of the ranking."""

    drafter: str
    family: str = ""
    tokenizer: str = ""
    shared: int | None = None
    shared_pct_target: float | None = None
    alpha_ceiling: float | None = None
    same_tokenizer: bool = False
    c: float | None = None
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    """algorithm -> why it cannot run on this pair."""
    measure_s: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> Measured:
        d = dict(d)
        known = {f.name for f in fields(Acceptance)}
        # caches written before use was counted per tested position hold a used_drafted (always 0 there: use is
        # added when ranking, never stored with what was measured)
        d["acceptance"] = {
            a: Acceptance(**{k: v for k, v in x.items() if k in known}) for a, x in d.get("acceptance", {}).items()
        }
        return cls(**d)


def best_k(alpha: float, c: float, v: dict[int, float], k_max: int = K_MAX) -> tuple[int, float]:
    """The draft length of the highest expected speedup at the measured v(k) (`theory.best_k`), and that speedup."""
    return theory.best_k(alpha, c, v.__getitem__, [k for k in range(1, k_max + 1) if k in v])


def rank(measured: Iterable[Measured], v: dict[int, float]) -> list[dict]:
    """One row per drafter plus plain decoding's (speedup 1), best expected speedup first; drafters that cannot run
    last. Each row says why it stands where it does."""
    rows = []
    for m in measured:
        row: dict[str, Any] = {
            "drafter": m.drafter,
            "family": m.family,
            "tokenizer": m.tokenizer,
            "shared": m.shared,
            "shared_pct_target": m.shared_pct_target,
            "alpha_ceiling": m.alpha_ceiling,
            "c": m.c,
            "algorithms": {},
            "best_algorithm": None,
            "best_k": None,
            "expected_speedup": None,
        }
        for algo in ALGORITHMS:
            if algo in m.unavailable:
                row["algorithms"][algo] = {"alpha": None, "why_not": m.unavailable[algo]}
                continue
            acc = m.acceptance.get(algo)
            if acc is None or acc.alpha is None:
                continue
            cell: dict[str, Any] = {
                "alpha": acc.alpha,
                "tokens": acc.drafted + acc.used_tested,
                "measured_tokens": acc.drafted,
                "used_tokens": acc.used_tested,
                "sampled_alpha": acc.sampled,
            }
            if m.c is not None and v:
                cell["best_k"], cell["expected_speedup"] = best_k(acc.alpha, m.c, v)
                if row["expected_speedup"] is None or cell["expected_speedup"] > row["expected_speedup"]:
                    row.update(best_algorithm=algo, best_k=cell["best_k"], expected_speedup=cell["expected_speedup"])
            row["algorithms"][algo] = cell
        row["note"] = _note(row, m)
        rows.append(row)
    rows.append(
        {
            "drafter": "(plain decoding)",
            "expected_speedup": 1.0,
            "note": "the target alone: the row to beat",
            "algorithms": {},
            "plain": True,
        }
    )
    runnable = sorted((r for r in rows if r["expected_speedup"] is not None), key=lambda r: -r["expected_speedup"])
    return runnable + [r for r in rows if r["expected_speedup"] is None]


def _note(row: dict, m: Measured) -> str:
    if row["expected_speedup"] is None:
        if m.unavailable and all(a in m.unavailable for a in ALGORITHMS):
            return "cannot draft for this target: " + "; ".join(f"{a}: {w}" for a, w in m.unavailable.items())
        return "not measured"
    if row["expected_speedup"] < 1.0:
        return (
            f"slower than plain decoding at every k: its step costs c = {m.c:.2f} of the target's, and "
            f"{row['best_algorithm']}'s alpha {row['algorithms'][row['best_algorithm']]['alpha']:.2f} does not "
            "make up for it"
        )
    return f"{row['best_algorithm']} at k = {row['best_k']}"


# --- measuring --------------------------------------------------------------------------------------------------------


@dataclass
class Model:
    """A loaded model, its runner and what the ranking reports about it."""

    name: str
    model: object
    tokenizer: object
    family: str = ""
    runner: Any = None
    """What opens its decoding contexts (by default the one `runners.runner_for` gives)."""

    def __post_init__(self):
        if self.runner is None:
            self.runner = runner_for(self.model)


@dataclass
class Reference:
    """The target's greedy answer to one prompt: its prompt ids, answer ids (ending with end of sequence when it
    ended) and its logits at each answer position (float16, for the sampled acceptance)."""

    prompt: Prompt
    target_prompt_ids: list[int]
    answer: list[int]
    logits: list[torch.Tensor]
    max_new_tokens: int


def _target_pair(target: Model, drafter: Model | None = None):
    from .pair import Pair

    return Pair(
        target.model,
        target.tokenizer,
        drafter.model if drafter else None,
        drafter.tokenizer if drafter else None,
        target_name=target.name,
        drafter_name=drafter.name if drafter else None,
        target_runner=target.runner,
        drafter_runner=drafter.runner if drafter else None,
    )


def _prompt_ids(pair, prompt: Prompt):
    from . import chat

    messages = list(prompt.messages) if prompt.messages is not None else None
    # "own": what `usd.stream` renders for the drafter in a fresh process (its auto tries own first)
    return chat.prompt_ids(pair, prompt.prompt, messages, rendering="own")


@torch.inference_mode()
def references(target: Model, prompts: Iterable[Prompt], max_new_tokens: int = ANSWER_TOKENS) -> list[Reference]:
    """The target's greedy answers, step by step as plain decoding makes them (`decoder.stream`, algorithm none)."""
    from .decoder import _prefill

    pair = _target_pair(target)
    eos = pair.eos_ids()
    out = []
    for prompt in prompts:
        t_ids, _ = _prompt_ids(pair, prompt)
        ctx = target.runner.new_context(t_ids)
        _prefill(ctx)
        answer: list[int] = []
        logits: list[torch.Tensor] = []
        while len(answer) < max_new_tokens:
            row = ctx.forward(keep=1)[-1]
            token = int(row.argmax())
            answer.append(token)
            logits.append(row.to(torch.float16))
            if token in eos:
                break
            ctx.ids.append(token)
        out.append(Reference(prompt, t_ids, answer, logits, max_new_tokens))
    return out


class _KnownAnswer:
    """A target whose greedy answer is known (a `Reference`), as a runner: its contexts' rows are one-hot at the
    reference's next token (past the reference, the end of sequence that ended it), so greedy verification keeps
    exactly what the real target would, and no model runs."""

    def __init__(self, ref: Reference, vocab: int, filler: int):
        self.ref, self.vocab, self.filler = ref, vocab, filler

    def new_context(self, ids: list[int]) -> _KnownContext:
        return _KnownContext(self, ids)

    def forget(self) -> None:
        """Nothing kept: the reference is the whole of its state."""

    def cpu_threads(self) -> None:
        return None  # no model computes


class _KnownContext:
    def __init__(self, known: _KnownAnswer, ids: list[int]):
        self.known, self.ids, self.forward_s = known, list(ids), 0.0

    def forward(self, keep: int = 0) -> torch.Tensor:
        ref = self.known.ref
        first = len(ref.target_prompt_ids)
        # the row at position p scores the token at p + 1: the answer's token (p + 1 - first)
        nxt = [
            ref.answer[i] if 0 <= i < len(ref.answer) else self.known.filler
            for i in range(len(self.ids) - (keep or 1) + 1 - first, len(self.ids) + 1 - first)
        ]
        return torch.nn.functional.one_hot(torch.tensor(nxt), self.known.vocab).float()

    def truncate(self, n: int) -> None:
        del self.ids[n:]


class _Recording:
    """A drafter's runner whose contexts remember the last row of every forward since `outputs` was last cleared (the
    replay's q under sampling: the first of a round's is the one its first candidate was drawn from)."""

    def __init__(self, runner):
        self.runner = runner
        self.outputs: list[torch.Tensor] = []

    def new_context(self, ids: list[int]):
        ctx = self.runner.new_context(ids)
        forward = ctx.forward

        def recorded(keep: int = 0) -> torch.Tensor:
            out = forward(keep=keep)
            self.outputs.append(out[-1])
            return out

        ctx.forward = recorded
        return ctx

    def forget(self) -> None:
        self.runner.forget()

    def cpu_threads(self) -> int | None:
        return self.runner.cpu_threads()


@torch.inference_mode()
def replay(target: Model, drafter: Model, ref: Reference, algorithm: str, k: int = 1, pair=None) -> Acceptance:
    """Greedy `algorithm` at fixed draft length `k` along the target's answer: the decode loop itself
    (`decoder.Generation`, from its plain rounds to its drafter resync) with the reference in place of the target's
    forwards. Returns what the loop's stats count (accepted, drafted), and for tli/standard the expected acceptance
    under sampling at SAMPLED_TEMPERATURE of each round's first candidate."""
    from dataclasses import replace

    from .decoder import Generation
    from .memory import PairMemory
    from .pair import model_vocab_size
    from .sampling import SamplingParams, probabilities
    from .settings import GenerationSettings

    base = pair or _target_pair(target, drafter)
    _, d_prompt = _prompt_ids(base, ref.prompt)
    recording = _Recording(base.drafter_runner)
    known = _KnownAnswer(ref, model_vocab_size(base.target), min(base.eos_ids()))
    # its own memory: the replay's rounds must not teach the pair's auto anything
    pair = replace(base, target_runner=known, drafter_runner=recording, memory=PairMemory())
    how = GenerationSettings(algorithm=algorithm, draft_tokens=k, max_new_tokens=ref.max_new_tokens)  # greedy
    chosen = how.algorithm
    gen = Generation(pair, ref.target_prompt_ids, d_prompt, how, True)
    sampled_params = SamplingParams(temperature=SAMPLED_TEMPERATURE)
    intersection = pair.intersection() if chosen.spec.proposes is Proposal.TOKENS else None
    out, sampled = Acceptance(), []
    while gen.answer.stop_reason is None:
        position = len(gen.answer.ids)
        recording.outputs.clear()
        done = gen.step()
        out.drafted += done.drafted
        out.accepted += done.accepted
        if intersection is not None and done.drafted and position < len(ref.logits):
            d_ids, t_ids, vocab_t = intersection
            q = target_proposal(probabilities(recording.outputs[0][d_ids], sampled_params), t_ids, vocab_t)
            p = probabilities(ref.logits[position].float(), sampled_params)
            sampled.append(float(torch.minimum(p[: len(q)], q[: len(p)]).sum()))
    out.sampled = sum(sampled) / len(sampled) if sampled else None
    return out


def _context(model: Model, ids: list[int]):
    ctx = model.runner.new_context(ids)
    ctx.forward(keep=1)
    return ctx


@torch.inference_mode()
def time_verify(target: Model, ref: Reference, repeats: int = REPEATS) -> dict:
    """v(k) = V(k + 1) / V(1) for k = 1..K_MAX on this machine, the lengths interleaved in every repeat."""
    base = ref.target_prompt_ids + ref.answer[:-1]
    ctx = _context(target, base)
    times: dict[int, list[float]] = {n: [] for n in range(1, K_MAX + 2)}
    for _ in range(repeats + 1):
        for n in range(K_MAX + 1, 0, -1):  # longest first: a sliding-window cache can always crop what it just fed
            times[n].append(timed_forward(ctx, base, n))
    med = {n: min(ts[1:]) for n, ts in times.items()}  # the first repeat warms up
    return {"v": {k: med[k + 1] / med[1] for k in range(1, K_MAX + 1)}, "step_s": med[1]}


@torch.inference_mode()
def time_c(target: Model, drafter: Model, ref: Reference, pair=None, repeats: int = REPEATS) -> float:
    """Drafter step / target step, each a single-token forward with a cache, timed alternately."""
    pair = pair or _target_pair(target, drafter)
    _, d_prompt = _prompt_ids(pair, ref.prompt)
    text = pair.target_tokenizer.decode(ref.answer[:-1], skip_special_tokens=True)
    t_base = ref.target_prompt_ids + ref.answer[:-1]
    d_base = d_prompt + pair.drafter_tokenizer.encode(text, add_special_tokens=False)
    t_ctx, d_ctx = _context(target, t_base), _context(drafter, d_base)
    t_times, d_times = [], []
    for _ in range(repeats + 1):
        t_times.append(timed_forward(t_ctx, t_base, 1))
        d_times.append(timed_forward(d_ctx, d_base, 1))
    return min(d_times[1:]) / min(t_times[1:])


def vocabulary(target: Model, drafter: Model) -> dict:
    """What `usd overlap` prints for the pair (shared vocabulary against the rows each model scores, tli's alpha
    ceiling as `alpha_ceiling_tli`), and whether the two tokenizers are one (`standard` can run)."""
    from .pair import model_vocab_size
    from .vocab import overlap_report, same_vocabulary

    report = overlap_report(
        target.tokenizer, drafter.tokenizer, model_vocab_size(target.model), model_vocab_size(drafter.model)
    )
    report["same_tokenizer"] = same_vocabulary(target.tokenizer, drafter.tokenizer)
    return report


def unavailable(pair, vocab: dict) -> dict[str, str]:
    """algorithm -> why it cannot run on this pair (absent: it can)."""
    why = {}
    if not vocab["same_tokenizer"]:
        why["standard"] = "needs identical tokenizers"
    if not vocab["shared"]:
        why["tli"] = "shares no vocabulary with the target"
    if not any(len(b) for b in pair.drafter_bytes.bytes_of.values()):
        why["slem"] = "its tokens spell no text the target could re-tokenize"
    return why


def measure(target: Model, drafter: Model, refs: list[Reference], log=lambda msg: None) -> Measured:
    """Everything the ranking needs about one drafter: vocabulary, ceiling, c, and each runnable algorithm's alpha."""
    t0 = time.perf_counter()
    pair = _target_pair(target, drafter)
    vocab = vocabulary(target, drafter)
    m = Measured(
        drafter.name,
        family=drafter.family,
        tokenizer=vocab["drafter_tokenizer"],
        shared=vocab["shared"],
        shared_pct_target=vocab["shared_pct_target"],
        alpha_ceiling=vocab["alpha_ceiling_tli"],
        same_tokenizer=vocab["same_tokenizer"],
        unavailable=unavailable(pair, vocab),
    )
    if len(m.unavailable) == len(ALGORITHMS):
        m.measure_s = time.perf_counter() - t0
        return m
    m.c = time_c(target, drafter, refs[0], pair)
    log(f"{drafter.name}: c = {m.c:.2f}")
    for algo in ALGORITHMS:
        if algo in m.unavailable:
            continue
        total, sampled = Acceptance(), []
        for ref in refs:
            a = replay(target, drafter, ref, algo, pair=pair)
            total.accepted += a.accepted
            total.drafted += a.drafted
            if a.sampled is not None:
                sampled.append((a.sampled, a.drafted))
        if sampled and sum(n for _, n in sampled):
            total.sampled = sum(s * n for s, n in sampled) / sum(n for _, n in sampled)
        m.acceptance[algo] = total
        log(
            f"{drafter.name}: {algo} alpha {total.alpha if total.alpha is not None else 0:.2f} "
            f"({total.accepted}/{total.drafted})"
        )
    m.measure_s = time.perf_counter() - t0
    return m


# --- the store: what was measured, and what use has added -------------------------------------------------------------

_LOCK = threading.Lock()


def store_path() -> Path:
    from .store import cache_dir

    return cache_dir() / "suggest.json"


def _read() -> dict:
    try:
        data = json.loads(store_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(data: dict) -> None:
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


@contextlib.contextmanager
def _editing() -> Iterator[dict]:
    with _LOCK:
        data = _read()
        yield data
        _write(data)


USE = "use"
"""The store's section of what use has shown: "target|drafter" -> algorithm -> [accepted, tested]. (An earlier
section, "used", held [accepted, drafted], which is not the per-position alpha at k > 1: it is not read.)"""


def record_acceptance(
    target: str, drafter: str, algorithm: str, accepted: int, tested: int, sampled: bool = False
) -> None:
    """Add a generation's accepted and tested positions (`schedule.tested_positions`, summed over its rounds) to what
    the pair has shown in use (greedy and sampled kept apart: the ranking's alpha is greedy's). Never raises: a
    read-only cache only means nothing is remembered."""
    if not (target and drafter and tested > 0) or algorithm not in ALGORITHMS or not recording_on():
        return
    key = f"{algorithm}@sampled" if sampled else algorithm
    with contextlib.suppress(OSError), _editing() as data:
        cell = data.setdefault(USE, {}).setdefault(f"{target}|{drafter}", {}).setdefault(key, [0, 0])
        cell[0] += int(accepted)
        cell[1] += int(tested)


RECORD_ENV = "USD_CHAT_RECORD"
"""0/false: remember nothing from use (the test suite sets it, so its generations do not count as use)."""


def recording_on() -> bool:
    return os.environ.get(RECORD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def used_acceptance(target: str, drafter: str) -> dict[str, list[int]]:
    """algorithm (or "algorithm@sampled") -> [accepted, tested] that use of the pair has recorded."""
    return _read().get(USE, {}).get(f"{target}|{drafter}", {})


def add_use(m: Measured, target: str) -> Measured:
    """`m` with what use of (target, m.drafter) has recorded under greedy decoding added to each measured alpha."""
    for algo, (accepted, tested) in used_acceptance(target, m.drafter).items():
        if algo in m.acceptance:
            m.acceptance[algo].used_accepted, m.acceptance[algo].used_tested = accepted, tested
    return m


def recording(pair, events: Iterator, greedy: bool) -> Iterator:
    """`events` passed through; at Finished, each algorithm's accepted and tested positions over this generation's
    rounds are added to the store (`record_acceptance`), once per generation, and what auto's cost model has learned
    of the pair is kept for the next process (`costs.remember`)."""
    from .costs import remember
    from .events import Finished, Round

    if not recording_on():
        yield from events
        return
    counts: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, Round) and event.drafted:
            cell = counts.setdefault(event.algorithm, [0, 0])
            cell[0] += event.accepted
            cell[1] += tested_positions(event.accepted, event.drafted)
        elif isinstance(event, Finished):
            remember(pair)
            for algo, (a, d) in counts.items() if pair.drafter_name else ():
                record_acceptance(pair.target_name, pair.drafter_name, algo, a, d, sampled=not greedy)
        yield event


@dataclass(frozen=True)
class PromptSet:
    """The prompts a ranking measures on, the key its cached numbers are kept under, and how long each answer is."""

    key: str
    """'code' | 'chat' | a JSONL file's name and hash, with its limit."""
    prompts: list[Prompt]
    answer_tokens: int = ANSWER_TOKENS


def prompt_set(spec: str, limit: int | None = None, answer_tokens: int = ANSWER_TOKENS) -> PromptSet:
    from .datasets import load_prompts

    if spec in PROMPT_SETS:
        prompts, key = list(PROMPT_SETS[spec]), spec
    else:
        prompts = load_prompts(spec)
        key = f"{Path(spec).name}:{hashlib.sha256(Path(spec).read_bytes()).hexdigest()[:12]}"
    if limit:
        prompts, key = prompts[:limit], f"{key}[:{limit}]"
    if not prompts:
        raise ValueError(f"the prompt set {spec!r} is empty")
    return PromptSet(key, prompts, answer_tokens)


# --- the whole run ----------------------------------------------------------------------------------------------------


def suggest(
    target: str,
    drafters: list[str],
    load: Callable[[str], Model],
    on: PromptSet,
    *,
    refresh: bool = False,
    precision: str | None = None,
    progress: Callable[[float | None, str], None] = lambda fraction, msg: None,
) -> dict:
    """Measure what is not cached yet, rank, and return {target, prompts, machine, v, rows}. `load(name)` gives a
    loaded Model (called only for what must be measured); cached numbers are keyed by machine, so the target is
    loaded whenever anything is measured, to know the machine it runs on. `precision` is the override `load` applies
    to every model (None: each its catalog's): a drafter's c depends on its runner and weights, which the target's
    machine does not say, so it keys each drafter's numbers too. `progress(fraction, message)` hears each stage (and,
    with fraction None, each drafter's measurement lines)."""
    prompts, answer_tokens = on.prompts, on.answer_tokens
    key_set = f"{on.key}@{answer_tokens}"
    progress(0.0, f"loading {target}")
    t = load(target)
    where = machine(t.model)
    data = _read()
    v_key = f"{where}|{target}"
    refs: list[Reference] | None = None

    def refs_once() -> list[Reference]:
        nonlocal refs
        if refs is None:
            progress(0.05, f"{target} answers {len(prompts)} prompts (the reference)")
            refs = references(t, prompts, answer_tokens)
        return refs

    timing = data.get("verify", {}).get(v_key)
    if timing is None or refresh:
        r = refs_once()
        progress(0.1, f"timing {target}'s verify forwards (k = 1..{K_MAX})")
        timing = time_verify(t, r[0])
        with _editing() as store:
            store.setdefault("verify", {})[v_key] = timing
    v = {int(k): x for k, x in timing["v"].items()}
    measured = []
    for i, name in enumerate(drafters):
        m_key = f"{where}|{target}|{name}@{precision or 'catalog'}|{key_set}"
        cached = _read().get("measured", {}).get(m_key)
        if cached is not None and not refresh:
            m = Measured.from_dict(cached)
        else:
            progress(0.15 + 0.85 * i / max(1, len(drafters)), f"measuring {name}")
            d = load(name)
            m = measure(t, d, refs_once(), log=lambda msg: progress(None, msg))
            with _editing() as store:
                store.setdefault("measured", {})[m_key] = asdict(m)
        measured.append(add_use(m, target))
    progress(1.0, "ranked")
    return {
        "target": target,
        "prompts": key_set,
        "machine": where,
        "v": v,
        "step_s": timing["step_s"],
        "rows": rank(measured, v),
    }


def _alpha(algos: dict, algorithm: str) -> str:
    cell = algos.get(algorithm)
    if cell is None:
        return "-"
    return "n/a" if cell["alpha"] is None else f"{cell['alpha']:.2f}"


def format_table(report: dict) -> str:
    """The ranking as a Markdown table (the CLI prints it; the README shows one)."""
    head = (
        "| # | drafter | family | tokenizer | shared (% of target) | tli ceiling | alpha tli | alpha slem | "
        "alpha standard | c | best | expected speedup | rests on | note |"
    )
    lines = [head, "|" + "---|" * 14]
    for i, r in enumerate(report["rows"], 1):
        if r.get("plain"):
            lines.append(f"| {i} | plain decoding | | | | | | | | | | 1.00x | | {r['note']} |")
            continue
        algos = r["algorithms"]

        shared = f"{r['shared']:,} ({r['shared_pct_target']:.1f}%)" if r["shared"] is not None else "-"
        ceiling = f"{r['alpha_ceiling']:.0%}" if r["alpha_ceiling"] is not None else "-"
        c = f"{r['c']:.2f}" if r["c"] is not None else "-"
        best = f"{r['best_algorithm']} k={r['best_k']}" if r["best_algorithm"] else "-"
        speed = f"{r['expected_speedup']:.2f}x" if r["expected_speedup"] is not None else "-"
        rests = ", ".join(
            f"{a}: {cell['tokens']} ({cell['used_tokens']} from use)" for a, cell in algos.items() if cell.get("tokens")
        )
        lines.append(
            f"| {i} | {r['drafter']} | {r['family']} | {r['tokenizer']} | {shared} | {ceiling} | "
            f"{' | '.join(_alpha(algos, a) for a in ALGORITHMS)} | {c} | {best} | {speed} | "
            f"{rests or '-'} | {r['note']} |"
        )
    return "\n".join(lines)


# --- `usd suggest` ----------------------------------------------------------------------------------------------------


def candidates(catalog, target: str, names: list[str] | None = None, every: bool = False) -> list[str]:
    """The drafters to rank: the named ones, or the catalog models on disk whose roles include drafter (`every`:
    any role), the target itself left out."""
    from .store import local_path

    if names:
        return [n for n in names if n != target]
    return [
        m.name
        for m in catalog.models
        if m.name != target and (every or "drafter" in m.roles) and local_path(m) is not None
    ]


def loader(
    catalog,
    device: str | None = None,
    precision: Precision | None = None,
    log=lambda msg: None,
    loaded: dict | None = None,
) -> Callable[[str], Model]:
    """name -> Model, each loaded once (pass `loaded` to reuse models already in memory, by name)."""
    from .loading import entry_for, load_model

    cache: dict[str, Model] = dict(loaded or {})

    def load(name: str) -> Model:
        if name not in cache:
            lm = load_model(entry_for(name, catalog), device=device, precision=precision, catalog=catalog, log=log)
            cache[name] = Model(lm.name, lm.model, lm.tokenizer, family=lm.entry.family, runner=lm.runner)
        return cache[name]

    return load


def add_arguments(p) -> None:
    from .settings import PRECISIONS

    add_pair_arguments(p, drafter=False)
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--drafters", metavar="NAME,...", help="drafters to rank (default: the catalog's drafters on this machine)"
    )
    who.add_argument("--all", action="store_true", help="every catalog model on this machine, whatever its roles")
    p.add_argument(
        "--prompts",
        default="code",
        metavar="{code,chat,FILE}",
        help="the prompt set: built-in code or chat prompts, or a JSONL file (default: code)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="use the first N prompts")
    p.add_argument(
        "--tokens",
        type=int,
        default=ANSWER_TOKENS,
        metavar="N",
        help=f"answer tokens per prompt (default: {ANSWER_TOKENS})",
    )
    p.add_argument("--refresh", action="store_true", help="measure again, ignoring the cached numbers")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="override the catalog's precision for every model (gguf: the GGUF on llama.cpp)",
    )


def run_cli(args, catalog) -> int:
    import sys

    def log(msg):
        print(msg, file=sys.stderr)

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if not 1 <= args.tokens <= 4096:
        raise ValueError(f"--tokens must be a whole number from 1 to 4,096, got {args.tokens}")
    target = args.target or catalog.default.target
    names = [n.strip() for n in args.drafters.split(",") if n.strip()] if args.drafters else None
    drafters = candidates(catalog, target, names, args.all)
    if not drafters:
        raise ValueError("no drafter to rank: none is on this machine (`usd pull NAME`), or name some with --drafters")
    on = prompt_set(args.prompts, args.limit, args.tokens)
    t0 = time.perf_counter()
    report = suggest(
        target,
        drafters,
        loader(catalog, args.device, args.precision),
        on,
        refresh=args.refresh,
        precision=args.precision,
        progress=lambda fraction, msg: log(msg),
    )
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"target {target} on {report['machine']}; prompts {report['prompts']}; target step "
        f"{1000 * report['step_s']:.1f} ms; v(k) for k = 1..{K_MAX}: "
        + " ".join(f"{report['v'][k]:.2f}" for k in sorted(report["v"]))
    )
    print(format_table(report))
    print(
        f"[{report['wall_s']:.1f} s; expected speedup = tau(alpha, k) / (k c + v(k)) at the best k, greedy alpha "
        "measured along the target's own answers plus what use has recorded]",
        file=sys.stderr,
    )
    return 0
