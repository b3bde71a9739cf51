"""What a round costs on this machine before any round has run: the drafter's step over the target's (c) and the
target's forward over k + 1 positions over its single step (v(k)), timed at load in a few forwards, or read from a
per-machine cache, as cpu_kernels and static_cache keep their choices. From them alone auto bounds what speculation
can gain here (`schedule.speedup_bound`): where no draft length could pay even if every drafted token were accepted,
it decodes plainly from the first round and never probes (docs/design.md §6).

The lengths timed are a step and the verifies of k = 1, 2, 4, 8 and 16, interleaved, each the fastest of a few
repeats (other work on a shared machine only ever adds time); the others are interpolated, as auto's cost model reads
V(n). The long ones are timed, not extrapolated from the short: a lookup drafts up to 16 tokens, and with exact rows
on a CPU a verify's cost per row past the first few is not its slope between two and four (extrapolated, a lookup's
first 16-token draft was priced far below what it took).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from .hugepages import huge_pages_in_use
from .memory import Learned, LoadCosts
from .runners import is_own_runner
from .runners.llamacpp import LlamaCppModel
from .runners.transformers.cpu_kernels import busy, cpu_name, read_choices, write_choices
from .schedule import speedup_bound
from .vocab import ceiling_of

FED = (17, 9, 5, 3, 2)
"""Positions a timed verify feeds besides the plain step (k = 16, 8, 4, 2, 1), longest first: a sliding-window cache
can always crop what it just fed."""
FEED = 32
"""Positions of the drafter's timed catch-up (a forward over what it lacks, as after plain rounds: `feed`)."""
REPEATS = 2
CONTEXT = 64
"""Tokens in the contexts timed: a short chat's prompt."""
CACHE_FILE = "pair-costs.json"
TEXT = (
    "Speculative decoding lets a small model propose several tokens that the large model then checks in one pass. "
    "When the proposals are right, the answer arrives faster; when they are wrong, nothing is lost but a little "
    "time. def fibonacci(n):\n    seq = [0, 1]\n    while len(seq) < n:\n        seq.append(seq[-1] + seq[-2])\n"
)


def timed_forward(ctx, base: list[int], n: int) -> float:
    """Seconds of one forward over the last n tokens of `base`, the cache holding the rest (as a verify forward)."""
    ctx.truncate(len(base) - n)
    if ctx.cached < len(ctx.ids):
        ctx.forward(keep=1)  # a sliding-window cache was rebuilt: refill it, untimed
    ctx.ids.extend(base[len(base) - n :])
    t0 = time.perf_counter()
    ctx.forward(keep=n)
    return time.perf_counter() - t0


def _context(runner, tokenizer):
    """A context holding CONTEXT tokens: a prompt, then a few tokens fed as an answer's are (the llama.cpp runner
    computes a prompt's positions on other kernels than an answer's, and cutting into a prompt re-feeds its batch)."""
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)[:CONTEXT]
    answer = max(FED) + 1
    ctx = runner.new_context(ids[:-answer])
    ctx.forward(keep=1)
    ctx.ids.extend(ids[-answer:])
    ctx.forward(keep=answer)
    return ctx, ids


@torch.inference_mode()
def measure(pair) -> LoadCosts:
    """The pair's step, c, v(k) (V(k + 1) / V(1)) and feed on this machine."""
    target, t_ids = _context(pair.target_runner, pair.target_tokenizer)
    drafter, d_ids = _context(pair.drafter_runner, pair.drafter_tokenizer)
    steps, draft_steps, feeds = [], [], []
    verify: dict[int, list[float]] = {n: [] for n in FED}
    timed_forward(target, t_ids, 1), timed_forward(drafter, d_ids, 1)  # warm both: a first forward pays page faults
    for _ in range(REPEATS):
        steps.append(timed_forward(target, t_ids, 1))
        for i, n in enumerate(FED):
            verify[n].append(timed_forward(target, t_ids, n))
            if i == 0:
                draft_steps.append(timed_forward(drafter, d_ids, 1))
                feeds.append(timed_forward(drafter, d_ids, min(FEED, len(d_ids) - 1)))
    for runner in (pair.target_runner, pair.drafter_runner):
        runner.forget()
    step, fed = min(steps), min(FEED, len(d_ids) - 1)
    v = {n - 1: min(t) / step for n, t in verify.items()}
    return LoadCosts(step_s=step, c=min(draft_steps) / step, v=v, feed=min(feeds) / fed / step)


def machine(model) -> str:
    """What the timings belong to: this host, its CPU and their count, the pages its large allocations get (huge or
    not: usd/hugepages.py), the device, the weights and the runner of the model. A model that is its own runner (the
    llama.cpp runner, precision gguf) runs its GGUF's own quantized weights and has no torch parameters to ask."""
    own_runner = is_own_runner(model)
    if own_runner:
        # llama.cpp's rule is part of the runner: the same model verifies in one call with exact rows, in several
        # without (kernels.py)
        rule = f"/{model.batching.key}" if isinstance(model, LlamaCppModel) else ""
        where, runner = f"{model.device.type}/gguf", f"{type(model).__name__}{rule}"
    else:
        param = next(iter(model.parameters()), None)
        where = f"{param.device.type}/{str(param.dtype).removeprefix('torch.')}" if param is not None else "?"
        runner = "transformers"
    pages = "huge-pages" if huge_pages_in_use() else "small-pages"
    return f"{platform.node()}/{cpu_name()}/{os.cpu_count()}cpu/{pages}/{where}/{runner}"


def machine_key(pair) -> str:
    return f"{machine(pair.target)}|threads={torch.get_num_threads()}|{pair.target_name}|{pair.drafter_name}"


def costs_for(pair, cache_dir: Path | None, log=print) -> LoadCosts | None:
    """This pair's c and v(k) on this machine: measured once (and again at each load while the machine is busy, as
    cpu_kernels does), then read from the cache. None for a pair without a drafter."""
    if pair.drafter is None:
        return None
    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    known = read_choices(cache)
    key = machine_key(pair)
    costs = LoadCosts.from_json(known.get(key))
    if costs is None:
        t0 = time.perf_counter()
        costs = measure(pair)
        took = time.perf_counter() - t0
        if busy():
            log(f"{pair.drafter_name}: the machine is busy, so c and v(k) are not cached (measured again next load)")
        else:
            known[key] = costs.to_json()
            write_choices(cache, known)
        log(f"{pair.drafter_name}: c and v(k) measured in {took:.2f} s: {describe(costs)}")
    else:
        log(f"{pair.drafter_name}: c and v(k) measured here before: {describe(costs)}")
    if not pair.same_tokenizer and speedup_bound(costs.c, costs.v)[1] >= 1:
        # only where a full acceptance could pay is tli's own cap worth its vocabulary alignment (a second or two)
        costs.tli_ceiling = ceiling_of(pair.target_tokenizer, set(pair.intersection()[1].tolist()))
    return costs


def describe(costs: LoadCosts) -> str:
    vs = ", ".join(f"v({k}) {v:.2f}" for k, v in sorted(costs.v.items()))
    k, bound = speedup_bound(costs.c, costs.v)
    verdict = "speculation can pay" if bound >= 1 else "no draft length can pay: auto decodes plainly"
    return (
        f"target step {costs.step_s * 1e3:.1f} ms, c {costs.c:.2f}, {vs}; at most {bound:.2f}x with every "
        f"draft accepted (k = {k}): {verdict}"
    )


LEARNED = "|learned"
"""The suffix of a pair's key under which the cost cache keeps what auto's cost model learned while decoding."""


def restore_learned(pair, cache_dir: Path | None) -> None:
    """Give the pair what auto learned of it on this machine in earlier processes (its cost model, its probing waits:
    `remember` keeps them), so that a restart does not probe again what is known to lose here."""
    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    key = machine_key(pair) + LEARNED
    pair.memory.learned_at = (cache, key)
    learned = Learned.from_json(read_choices(cache).get(key))
    if learned is not None:
        pair.memory.schedule = learned


def remember(pair) -> None:
    """Keep what auto learned of the pair so far (after a generation) for the next process on this machine."""
    cache, key = pair.memory.learned_at or (None, None)
    if cache is None or pair.memory.schedule == Learned():
        return
    try:
        learned = json.loads(json.dumps(pair.memory.schedule.to_json()))
    except (RuntimeError, TypeError, ValueError):  # another generation of the pair changed it meanwhile: next time
        return
    known = read_choices(cache)
    known[key] = learned
    write_choices(cache, known)
