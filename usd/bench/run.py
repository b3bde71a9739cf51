"""`usd bench`: every algorithm side by side on the same prompts, in one process, with ratios that survive a noisy
machine: a warm-up first, then per prompt every algorithm in turn (the order rotates from prompt to prompt so no
algorithm always runs first or last). `hf` is transformers' own cross-tokenizer assisted generation on the same
loaded models (with its own copy of the drafter, since its sampling path rewires the drafter in place).

Ratios are speedups: speedup_vs_none = none's wall time / this algorithm's (above 1 is faster).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

import torch

from .. import chat, decoder, settings, suggest
from ..algorithms import PLAIN, Algorithm
from ..catalog import Precision, add_pair_arguments, drafter_arg
from ..datasets import Prompt, load_prompts
from ..events import Finished
from ..pair import Pair
from ..sampling import SamplingParams
from ..settings import GenerationSettings
from ..suffix import SuffixMemory
from .plots import plot
from .report import REFERENCES, label, pair_plot_path, table

ALGORITHMS = (*settings.ALGORITHMS, *REFERENCES)
"""The generation algorithms, and the references only the benchmark runs (report.REFERENCES)."""
DEFAULT_ALGORITHMS = (PLAIN, Algorithm.TLI, Algorithm.SLEM, Algorithm.AUTO)
SWEEP_K = tuple(range(1, 9))
"""`--draft-tokens sweep`: every drafting algorithm at each of these draft lengths."""
SUMMARY_KEYS = (
    "algorithm",
    "k",
    "wall_s",
    "tokens_per_s",
    "speedup_vs_none",
    "speedup_vs_hf",
    "speedup_vs_llamacpp",
    "acceptance_rate",
    "alpha_by_source",
    "tokens_per_round",
    "mean_k",
    "c",
    "v",
    "overhead_share",
    "predicted_speedup",
    "identical_to_none",
)


@dataclass
class Run:
    prompt: str
    algorithm: str
    k: int | str | None
    """The draft length asked for: a number, "auto", 0 for plain decoding, None for transformers (its own)."""
    target_ids: list[int]
    wall_s: float
    tokens: int
    rounds: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    mean_k: float | None = None
    c: float | None = None
    v: float | None = None
    forward_s: float | None = None
    stop_reason: str | None = None
    drafted_by: dict = field(default_factory=dict)
    """Drafted candidates per source (the algorithm that drafted them: ngram's lookup, the drafter model's)."""
    accepted_by: dict = field(default_factory=dict)


def _ids(pair: Pair, prompt: Prompt) -> tuple[list[int], list[int] | None]:
    messages = list(prompt.messages) if prompt.messages else None
    return chat.prompt_ids(pair, prompt.prompt, messages, rendering="own")


def run_ours(pair: Pair, prompt: Prompt, how: GenerationSettings, record: bool = True, memory=None) -> Run:
    """One generation through the engine. With `record`, its acceptance refines what `usd suggest` remembers of the
    pair, as a chat's does (`suggest.recording`). `memory`: the suffix memory scope it drafts from and joins."""
    t_ids, d_ids = _ids(pair, prompt)
    done: Finished | None = None
    events = decoder.stream(pair, t_ids, d_ids, how, memory=memory)
    if record:
        events = suggest.recording(pair, events, greedy=how.greedy)
    for event in events:
        if isinstance(event, Finished):
            done = event
    assert done is not None  # the stream ends with its Finished
    s = done.stats
    return Run(
        prompt.id,
        how.algorithm.value,
        0 if how.algorithm.plain else how.draft_tokens,
        list(done.target_ids),
        s.wall_s,
        s.tokens,
        s.rounds,
        s.drafted,
        s.accepted,
        s.mean_k,
        s.c,
        s.v,
        s.forward_s,
        s.stop_reason,
        dict(s.drafted_by_algorithm),
        dict(s.accepted_by_algorithm),
    )


@torch.inference_mode()
def run_hf(pair: Pair, hf_drafter, prompt: Prompt, params: SamplingParams, max_new_tokens: int) -> Run:
    t_ids, _ = _ids(pair, prompt)
    eos = sorted(pair.eos_ids())
    device = pair.target.device
    kwargs = (
        {"do_sample": False}
        if params.greedy
        else {
            "do_sample": True,
            "temperature": params.temperature,
            "top_k": params.top_k or None,
            "top_p": params.top_p,
        }
    )
    if params.seed is not None:
        torch.manual_seed(params.seed)
    # transformers refuses the tokenizers when both models share one (it then runs its same-vocabulary assisted path)
    tokenizers = (
        {}
        if pair.same_tokenizer
        else {"tokenizer": pair.target_tokenizer, "assistant_tokenizer": pair.drafter_tokenizer}
    )
    t0 = time.perf_counter()
    out = pair.target.generate(
        torch.tensor([t_ids], device=device),
        attention_mask=torch.ones(1, len(t_ids), device=device),
        assistant_model=hf_drafter,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0],
        **kwargs,
        **tokenizers,
    )
    wall = time.perf_counter() - t0
    ids = out[0, len(t_ids) :].tolist()
    for j, t in enumerate(ids):  # ours reports the answer without its end-of-sequence token
        if t in eos:
            ids = ids[:j]
            break
    return Run(prompt.id, "hf", None, ids, wall, len(ids))


def forget_caches(pair: Pair) -> None:
    """Empty the llama.cpp caches a pair keeps between generations (transformers' are per generation already), so
    that no run reuses the prompt another one just read."""
    from ..runners.llamacpp import LlamaCppModel

    for model in (pair.target, pair.drafter):
        if isinstance(model, LlamaCppModel):
            model.forget()


def reference_llama(pair: Pair):
    """llama-cpp-python's high-level `Llama` on the target's GGUF, as a user would open it: its default kernels
    (repacked weights and all), the same threads and context as our runner's."""
    from ..runners.llamacpp import LlamaCppModel
    from ..runners.llamacpp.binding import library

    target = pair.target
    if not isinstance(target, LlamaCppModel):
        raise ValueError("the llamacpp reference runs the target's GGUF: load the pair with --precision gguf")
    library()  # the backend initialised and its log quieted, once for both
    from llama_cpp import Llama

    return Llama(
        model_path=str(target.path), n_ctx=target.n_ctx, n_threads=target.n_threads, n_gpu_layers=0, verbose=False
    )


def run_llamacpp(pair: Pair, llm, prompt: Prompt, params: SamplingParams, max_new_tokens: int) -> Run:
    t_ids, _ = _ids(pair, prompt)
    eos = pair.eos_ids()
    if params.greedy:
        sampling = {"temp": 0.0, "top_k": 1}
    else:
        sampling = {"temp": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p, "min_p": 0.0}
        llm.set_seed(params.seed if params.seed is not None else -1)
    ids: list[int] = []
    llm.reset()  # from scratch, like our runs (forget_caches)
    t0 = time.perf_counter()
    for token in llm.generate(t_ids, repeat_penalty=1.0, reset=True, **sampling):
        if token in eos:
            break
        ids.append(token)
        if len(ids) >= max_new_tokens:
            break
    wall = time.perf_counter() - t0
    return Run(prompt.id, "llamacpp", None, ids, wall, len(ids))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def variants(algorithms: list[Algorithm | str], k) -> list[tuple[str, int | str | None]]:
    """(algorithm, draft length) pairs to run: plain decoding once, transformers once (it picks its own length), and
    every drafting algorithm at `k`, or at each k of SWEEP_K when k is "sweep"."""
    out: list[tuple[str, int | str | None]] = []
    for a in algorithms:
        if not isinstance(a, Algorithm):  # a reference generates on its own and picks its own length
            out.append((a, None))
        elif a.plain:
            out.append((a, 0))
        else:
            out += [(a, kk) for kk in SWEEP_K] if k == "sweep" else [(a, k)]
    return out


def _predicted(runs: list[Run], drafted: int, verify_rounds: float) -> float | None:
    """The theory's S = tau(alpha, k) / (k c + v) from this row's measured alpha, mean k, c and v: what the cost
    model would expect, to set beside the measured speedup."""
    from ..theory import expected_speedup

    c, v = _mean(r.c for r in runs), _mean(r.v for r in runs)
    if not drafted or c is None or v is None or not verify_rounds:
        return None
    alpha = sum(r.accepted or 0 for r in runs) / drafted
    return expected_speedup(alpha, max(1, round(drafted / verify_rounds)), c, v)


def _alpha_by_source(runs: list[Run]) -> dict[str, float]:
    """Acceptance per source over the runs: what auto's mix of sources achieved with each."""
    drafted: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for r in runs:
        for source, n in r.drafted_by.items():
            drafted[source] = drafted.get(source, 0) + n
            accepted[source] = accepted.get(source, 0) + r.accepted_by.get(source, 0)
    return {source: accepted[source] / n for source, n in sorted(drafted.items()) if n}


def summarize(runs: list[Run], plan: list[tuple], greedy: bool) -> list[dict]:
    by = {v: [r for r in runs if (r.algorithm, r.k) == v] for v in plan}
    walls = {v: sum(r.wall_s for r in rs) for v, rs in by.items()}
    none_wall = walls.get((PLAIN, 0))
    hf_wall = walls.get(("hf", None))
    llama_wall = walls.get(("llamacpp", None))
    plain = {r.prompt: r.target_ids for r in by.get((PLAIN, 0), [])}
    rows = []
    for (a, k), rs in by.items():
        wall = walls[(a, k)]
        tokens = sum(r.tokens for r in rs)
        ours = a not in REFERENCES
        drafted = sum(r.drafted or 0 for r in rs)
        verify_rounds = sum((r.drafted / r.mean_k) if r.drafted is not None and r.mean_k else 0 for r in rs)
        forward = sum(r.forward_s or 0.0 for r in rs)
        rows.append(
            {
                "algorithm": a,
                "k": k,
                "wall_s": wall,
                "tokens_per_s": tokens / wall if wall else 0.0,
                "speedup_vs_none": none_wall / wall if none_wall and wall else None,
                "speedup_vs_hf": hf_wall / wall if hf_wall and wall else None,
                "speedup_vs_llamacpp": llama_wall / wall if llama_wall and wall else None,
                "acceptance_rate": sum(r.accepted or 0 for r in rs) / drafted if ours and drafted else None,
                "alpha_by_source": _alpha_by_source(rs) if ours else None,
                "tokens_per_round": tokens / sum(r.rounds or 0 for r in rs) if ours else None,
                "mean_k": drafted / verify_rounds if ours and verify_rounds else (0.0 if ours else None),
                "c": _mean(r.c for r in rs) if ours else None,
                "v": _mean(r.v for r in rs) if ours else None,
                "overhead_share": max(0.0, 1 - forward / wall) if ours and wall else None,
                "predicted_speedup": _predicted(rs, drafted, verify_rounds) if ours and a != PLAIN else None,
                "identical_to_none": (all(r.target_ids == plain[r.prompt] for r in rs) if plain else None)
                if greedy
                else None,
                # the rate, not just all-or-none: in bf16 or 4-bit, rounding can swap near-tied tokens (usd.numerics)
                "identical_rate": (sum(r.target_ids == plain[r.prompt] for r in rs) / len(rs) if plain and rs else None)
                if greedy
                else None,
                "tokens": tokens,
            }
        )
    return rows


def target_precision(pair: Pair) -> str:
    """What the identity column's heading names: the target's weights as they ran."""
    from ..runners.llamacpp import LlamaCppModel

    if isinstance(pair.target, LlamaCppModel):
        return "gguf"
    return str(pair.target.dtype).replace("torch.", "")


def machine(pair: Pair) -> dict:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "target": pair.target_name,
        "drafter": pair.drafter_name,
        "dtype": target_precision(pair),
    }


def _on_llamacpp(model) -> bool:
    from ..runners import Runner

    return isinstance(model, Runner)  # a model that is its own runner (llama.cpp's), not a transformers model


def bench(
    pair: Pair,
    prompts: list[Prompt],
    algorithms: list[Algorithm | str],
    k="auto",
    params: SamplingParams | None = None,
    max_new_tokens: int = 64,
    log=print,
) -> dict:
    """Run every (algorithm, k) of `variants` on every prompt, interleaved, after a warm-up. k may be "sweep"."""
    params = params or SamplingParams()
    if pair.drafter is None:
        needing = [a for a in algorithms if a == "hf" or (isinstance(a, Algorithm) and a.needs_drafter)]
        if needing:
            raise ValueError(f"{', '.join(needing)} need a drafter model; leave them out or load one (--drafter)")
    algorithms = [
        a for a in algorithms if not isinstance(a, Algorithm) or not a.spec.one_tokenizer or pair.same_tokenizer
    ]
    plan = variants(algorithms, k)
    if "hf" in algorithms:
        models = ((pair.target_name, pair.target), (pair.drafter_name or "the drafter", pair.drafter))
        on_llamacpp = [name for name, model in models if _on_llamacpp(model)]
        if on_llamacpp:
            raise ValueError(hf_needs_transformers(on_llamacpp))
    hf_drafter = copy.deepcopy(pair.drafter) if "hf" in algorithms else None
    llm = reference_llama(pair) if "llamacpp" in algorithms else None
    # each variant remembers its own answers, prompt after prompt, as a server of its own would (the warm-up nothing)
    memory = SuffixMemory()

    def one(prompt, variant, n, seed, record=True):
        a, kk = variant
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
        forget_caches(pair)  # every run reads its prompt from scratch, as the references do
        if a == "hf":
            return run_hf(pair, hf_drafter, prompt, p, n)
        if a == "llamacpp":
            return run_llamacpp(pair, llm, prompt, p, n)
        scope = memory.scope(pair.tokenizer_key, label(a, kk)) if record else None
        how = GenerationSettings(
            algorithm=a,
            draft_tokens=kk or "auto",  # plain decoding's 0: it drafts nothing whatever this says
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=seed,
            max_new_tokens=n,
        )
        return run_ours(pair, prompt, how, record, scope)

    log(f"warm-up: every algorithm once on {prompts[0].id}, 8 tokens")
    first: dict[str, tuple[str, int | str | None]] = {}
    for a, kk in plan:
        first.setdefault(a, (a, kk))
    learned = copy.deepcopy(pair.memory.schedule)
    for variant in first.values():  # not recorded: it repeats the opening of the first prompt, measured below
        one(prompts[0], variant, 8, params.seed, record=False)
    # nor learned from: auto would take the warm-up's 8 tokens for the pair's typical answer, and size the first
    # answers' probing budgets by it, where a user's first answer follows none
    pair.memory.schedule = learned
    runs = []
    for i, prompt in enumerate(prompts):
        order = plan[i % len(plan) :] + plan[: i % len(plan)]
        seed = None if params.seed is None else params.seed + i
        for variant in order:
            runs.append(one(prompt, variant, max_new_tokens, seed))
        done = {(r.algorithm, r.k): r for r in runs[-len(order) :]}
        log(f"[{i + 1}/{len(prompts)}] {prompt.id}: " + "  ".join(f"{label(*v)} {done[v].wall_s:.2f}s" for v in plan))
    return {
        "summary": summarize(runs, plan, params.greedy),
        "prompts": [asdict(r) for r in runs],
        "machine": machine(pair),
        "settings": {
            "k": k,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "seed": params.seed,
            "max_new_tokens": max_new_tokens,
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument(
        "--dataset",
        default="humaneval",
        help="humaneval, mtbench, edits (HumanEval's solutions to change, MT-Bench's extraction questions), recall "
        "(sessions asking for an earlier answer again, in new conversations), or a JSONL file (prompt or messages)",
    )
    p.add_argument("--limit", type=int, default=20, help="how many prompts (default 20)")
    p.add_argument(
        "--algorithms",
        help=f"comma-separated, from {','.join(ALGORITHMS)} (default {','.join(DEFAULT_ALGORITHMS)}, and hf when "
        "both models run on transformers: hf needs transformers models, not llama.cpp's)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--draft-tokens",
        default="auto",
        help=f"K (1-{settings.DRAFT_TOKENS_MAX}), auto (adapt per round; default) or sweep (each k of "
        f"{SWEEP_K[0]}..{SWEEP_K[-1]})",
    )
    p.add_argument("--plot", metavar="OUT.png", help="write the figures (speedups, alpha/tau against k, theory)")
    p.add_argument(
        "--pairs",
        metavar="suggested",
        help="'suggested': every suggested pair of the catalog whose models are on this machine",
    )
    p.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    p.add_argument("--csv", metavar="OUT", help="write the summary rows as CSV")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument(
        "--precision", choices=get_args(Precision), help="for both models; identity checks want fp32 on a CPU"
    )


def parse_k(text: str):
    """--draft-tokens: what generation accepts (usd.settings), or "sweep", which only the benchmark has."""
    if text == "sweep":
        return text
    try:
        return settings.check_draft_tokens(int(text) if text.isdigit() else text)
    except ValueError:
        raise ValueError(
            f"--draft-tokens must be a number from 1 to {settings.DRAFT_TOKENS_MAX}, auto or sweep, got {text!r}"
        ) from None


def pairs_to_run(args, catalog) -> list[tuple[str | None, str | Literal[False] | None]]:
    """The pairs this invocation benchmarks: the one named (or the default; `--drafter none`: no drafter model, as
    `api.load_pair` takes it), or every suggested pair whose two models are already on this machine."""
    if not args.pairs:
        return [(args.target, drafter_arg(args.drafter))]
    if args.pairs != "suggested":
        raise ValueError(f"--pairs takes 'suggested', got {args.pairs!r}")
    from ..store import local_path

    ready = [
        (p.target, p.drafter)
        for p in catalog.pairs
        if local_path(catalog.get(p.target)) is not None and local_path(catalog.get(p.drafter)) is not None
    ]
    if not ready:
        raise ValueError("no suggested pair has both models on this machine; `usd pull` one (see `usd models`)")
    return ready


def hf_needs_transformers(gguf_names: list[str]) -> str:
    return (
        f"the hf reference (transformers' assisted generation) needs transformers models, but "
        f"{' and '.join(gguf_names)} load as gguf on llama.cpp here: add --precision fp32 to load both on "
        "transformers, or leave hf out of --algorithms"
    )


def gguf_models(pairs, catalog, device: str | None, precision: Precision | None) -> list[str]:
    """The models of `pairs` that would load on a runner transformers' own generate cannot drive (llama.cpp), known
    before loading any."""
    from ..loading import default_device, entry_for, needs_conversion

    names = []
    for target, drafter in pairs:
        drafter = catalog.default.drafter if drafter is None else drafter
        for spec in (target or catalog.default.target, *([drafter] if drafter else [])):
            entry = entry_for(spec, catalog)
            if not needs_conversion(entry, device or default_device(), precision) and entry.name not in names:
                names.append(entry.name)
    return names


def run_cli(args, catalog=None) -> int:
    from ..api import load_pair
    from ..catalog import load_catalog

    catalog = catalog or load_catalog()
    pairs = pairs_to_run(args, catalog)
    if args.algorithms is None:
        on_llamacpp = gguf_models(pairs, catalog, args.device, args.precision)
        algorithms = list(DEFAULT_ALGORITHMS) + ([] if on_llamacpp else ["hf"])
    else:
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    algorithms = [a if a in REFERENCES else settings.check_algorithm(a) for a in algorithms]
    if "hf" in algorithms:
        on_llamacpp = gguf_models(pairs, catalog, args.device, args.precision)
        if on_llamacpp:
            raise ValueError(hf_needs_transformers(on_llamacpp))
    k = parse_k(args.draft_tokens)
    if "llamacpp" in algorithms:
        from ..runners import llamacpp

        if not llamacpp.available():
            raise ValueError(f"the llamacpp reference: {llamacpp.INSTALL_HINT}")
    prompts = load_prompts(args.dataset, args.limit)
    if not prompts:
        raise ValueError(f"dataset {args.dataset} has no prompts")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    results = []
    for target, drafter in pairs:
        pair = load_pair(target, drafter, catalog=catalog, device=args.device, precision=args.precision, log=log)
        result = bench(pair, prompts, algorithms, k, params, args.max_new_tokens, log=log)
        result["settings"]["dataset"] = args.dataset
        summary = table(result["summary"], result["machine"]["dtype"])
        print(f"\n{pair.target_name} + {pair.drafter_name}, {args.dataset}:\n{summary}")
        if args.plot:
            out = args.plot if not args.pairs else pair_plot_path(args.plot, result)
            plot(result, out)
            log(f"plot: {out}")
        results.append(result)
        del pair
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results[0] if not args.pairs else {"pairs": results}, f, indent=1)
    if args.csv:
        keys = list(SUMMARY_KEYS) + (["target", "drafter"] if args.pairs else [])
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for result in results:
                w.writerows(
                    {**row, "target": result["machine"]["target"], "drafter": result["machine"]["drafter"]}
                    for row in result["summary"]
                )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m usd.bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
