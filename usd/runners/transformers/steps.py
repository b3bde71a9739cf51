"""On a GPU, which kind of decoding steps a transformers model runs on (static_cache.py): the fastest of those that
run, measured per model at load time (the model, its precision and the GPU decide it: bitsandbytes' 4-bit matmuls
break a compiled graph, say), the choice cached per machine as `cpu_kernels` caches a CPU's Linear backend
(docs/design.md §7)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .cpu_kernels import read_choices, write_choices
from .runner import TransformersRunner
from .static_cache import KINDS, supports

PROMPT = 256
"""Positions in the cache when a kind is timed: a short chat's prompt."""
VERIFY_ROWS = 5
"""The verify timed beside the one-token step (k = 4)."""
REPEATS = 5
MARGIN = 0.9
"""Another kind must be at least 10% faster than transformers' own cache to be used: noise should not flip it."""
CACHE_FILE = "gpu-steps.json"


@torch.inference_mode()
def time_kind(runner: TransformersRunner) -> dict:
    """Seconds of a one-token step and of a VERIFY_ROWS-token verify after a PROMPT-token prompt (the fastest of
    REPEATS each, the cache rolled back after each), and of the first step (which compiles)."""
    model = runner.model
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    ctx = runner.new_context(torch.randint(vocab, (PROMPT,), generator=g).tolist())
    ctx.forward(keep=1)
    base = len(ctx.ids)

    def timed(rows: int) -> float:
        ctx.ids += torch.randint(vocab, (rows,), generator=g).tolist()
        t0 = time.perf_counter()
        ctx.forward(keep=rows)  # copies the logits to the CPU: the device has finished when it returns
        seconds = time.perf_counter() - t0
        ctx.truncate(base)
        return seconds

    first = timed(1)
    timed(1)  # CUDA graphs record on the second call
    return {
        "first_s": first,
        "step_s": min(timed(1) for _ in range(REPEATS)),
        "verify_s": min(timed(VERIFY_ROWS) for _ in range(REPEATS)),
    }


def machine_key(model) -> str:
    import transformers

    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else model.device.type
    return f"{device}|torch={torch.__version__}|transformers={transformers.__version__}"


def choose_steps(model, model_name: str, precision: str, cache_dir: Path | None, log=print) -> TransformersRunner:
    """The runner on the fastest kind for this model on this machine, measured once (a failing kind, such as a
    compile that breaks, is skipped and said), then read from the cache."""
    if not supports(model):
        log(f"{model_name}: decoding on transformers' own cache (its layers need it: sliding window or recurrent)")
        return TransformersRunner(model)
    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    known = read_choices(cache)
    key = f"{machine_key(model)}|{model_name}|{precision}"
    runners: dict[str, TransformersRunner] = {}
    if key not in known:
        known[key] = measure_kinds(model, model_name, log, runners)
        write_choices(cache, known)
    choice = known[key]
    runner = runners.get(choice["kind"]) or TransformersRunner(model, choice["kind"])  # what was measured, compiled
    first = time_kind(runner)["first_s"]  # a step compiles now, not in the first answer
    timings = ", ".join(f"{k} {t['step_s'] * 1e3:.1f}/{t['verify_s'] * 1e3:.1f} ms" for k, t in choice["timed"].items())
    log(
        f"{model_name}: decoding steps {runner.steps} (measured here, one-token step/{VERIFY_ROWS}-token verify: "
        f"{timings}; first step now {first:.2f} s)"
    )
    return runner


def measure_kinds(model, model_name: str, log, runners: dict | None = None) -> dict:
    """Each kind timed (`time_kind`); `runners` gets the runner of each kind that ran."""
    timed = {}
    for kind in KINDS:
        try:
            runner = TransformersRunner(model, kind)
            timed[kind] = time_kind(runner)
        except Exception as e:  # a kind that fails on this model (a compile that breaks) is not a failed load
            log(f"{model_name}: {kind} decoding steps do not run here ({type(e).__name__}: {e}); not used")
            continue
        if runners is not None:
            runners[kind] = runner
    return {"kind": best_kind(timed), "timed": timed}


def best_kind(timed: dict) -> str:
    """The kind with the least step + verify time, if it beats transformers' own cache by the margin."""
    cost = {k: t["step_s"] + t["verify_s"] for k, t in timed.items()}
    if "dynamic" not in cost:
        return "dynamic"
    best = min(cost, key=lambda kind: cost[kind])
    return best if cost[best] < MARGIN * cost["dynamic"] else "dynamic"
