"""On a GPU, how a transformers model's decoding forwards run: on transformers' growing cache (`pair.Context`), on a
preallocated one (`StaticContext`), or on a preallocated one with the one-token step compiled (CUDA graphs replay
the whole step as one launch). A small model's step on a GPU costs mostly kernel launches, which the compiled step
removes; a verify of k + 1 rows stays eager, since each k would compile its own graph. Which one is fastest depends
on the model, its precision (bitsandbytes' 4-bit matmuls break the graph) and the GPU, so it is measured per model
at load time and the choice is cached per machine, as `cpu_kernels` does for a CPU's Linear layers
(docs/design.md §7).

Lossless: every kind gives the same tokens for the same logits. The compiled step and an eager verify row sum in
different orders, so their logits differ by rounding; greedy identity then holds up to the near-ties docs/design.md
§8 describes for bf16 and 4-bit models on a GPU.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import torch

from .cpu_kernels import read_choices, write_choices
from .pair import Context, open_context

KINDS = ("dynamic", "static", "compiled")
MIN_POSITIONS = 512
"""A static cache's first size. It doubles when a context outgrows it (copying what it holds, so no position is
computed twice), and each size compiles the step once per process."""
PROMPT = 256
"""Positions in the cache when a kind is timed: a short chat's prompt."""
VERIFY_ROWS = 5
"""The verify timed beside the one-token step (k = 4)."""
REPEATS = 5
MARGIN = 0.9
"""Another kind must be at least 10% faster than transformers' own cache to be used: noise should not flip it."""
CACHE_FILE = "gpu-steps.json"


def positions_for(n: int) -> int:
    """The static cache size that holds n positions: MIN_POSITIONS doubled as often as needed."""
    size = MIN_POSITIONS
    while size < n:
        size *= 2
    return size


class CachePool:
    """One model's static caches, reused from context to context. A CUDA graph replays on the addresses it was
    recorded with: a context bringing new tensors each time would make the compiled step record again, and after
    enough times give up on graphs."""

    def __init__(self, config):
        self.config = config
        self.free: list = []
        self.lock = threading.Lock()

    def take(self, positions: int):
        from transformers import StaticCache

        size = positions_for(positions)
        with self.lock:
            # exactly the size `positions` calls for, never a larger one that happens to be free: attention runs over
            # the whole cache, so its length (and the logits' rounding) must not depend on the pool's state
            cache = next((c for c in self.free if size_of(c) == size), None)
            if cache is not None:
                self.free.remove(cache)
                with torch.inference_mode():  # its length was made there
                    for layer in cache.layers:
                        layer.cumulative_length.zero_()
                return cache
        return StaticCache(config=self.config, max_cache_len=size)

    def give(self, cache) -> None:
        with self.lock:
            self.free.append(cache)


def size_of(cache) -> int:
    return cache.layers[0].max_cache_len


class StaticContext(Context):
    """A `Context` on a static cache from the model's pool, given back when the context is dropped. A rollback only
    moves the cache's length back (the next forward overwrites what lay beyond, and attention masks it until then);
    a one-token forward runs `step` when given (the model's compiled forward)."""

    def __init__(self, model, ids: list[int], pool: CachePool, step=None):
        self.pool, self.step = pool, step
        super().__init__(model, ids)

    def _new_cache(self, positions: int = MIN_POSITIONS):
        self.sliding = False  # static caches are only used for plain attention layers (`supports`)
        self.recurrent = None
        cache = self.pool.take(positions)
        self._give_back = weakref.finalize(self, self.pool.give, cache)
        return cache

    def _run(self, fresh: torch.Tensor, keep: int) -> torch.Tensor:
        self._make_room(self.cached + fresh.shape[1])
        if self.step is not None and fresh.shape[1] == 1:
            return self.step(fresh, self.cache)
        return super()._run(fresh, keep)

    @torch.inference_mode()
    def _rollback(self, drop: int) -> None:
        super()._rollback(drop)  # the cache's length is a tensor made in inference mode: it moves back in it too

    def _make_room(self, n: int) -> None:
        """Move to a bigger cache when n positions would not fit, copying what this one holds: no position is
        computed again, so its bits stay what they were."""
        if n <= size_of(self.cache):
            return
        old, give_old = self.cache, self._give_back
        self.cache = self._new_cache(n)
        for was, now in zip(old.layers, self.cache.layers, strict=True):
            if not was.is_initialized:
                continue
            if not now.is_initialized:
                now.lazy_initialization(was.keys, was.values)  # dtype, device and heads from the old tensors
            now.keys[:, :, : self.cached].copy_(was.keys[:, :, : self.cached])
            now.values[:, :, : self.cached].copy_(was.values[:, :, : self.cached])
            now.cumulative_length.fill_(self.cached)
        give_old()  # the old cache goes back to the pool now


def supports(model) -> bool:
    """Whether a model can decode on a static cache: a plain attention cache in every layer, as transformers lays
    them out (no sliding window, whose static form cannot be rolled back once it wraps; no recurrent state)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):  # a config transformers cannot lay out: keep its own cache
        return False
    return set(layer_types) == {"full_attention"}


class CompiledStep:
    """A model's compiled one-token forward, made once per model (so a choice read from the cache reuses what the
    measurement compiled). One call at a time: a CUDA graph replays into the same output buffers, so two server slots
    stepping at once would read each other's logits; the lock holds until the caller has its own copy."""

    def __init__(self, model, mode: str):
        self.forward = torch.compile(model.forward, mode=mode, dynamic=False)
        self.lock = threading.Lock()

    def __call__(self, fresh: torch.Tensor, cache) -> torch.Tensor:
        with self.lock:
            # logits_to_keep is a constant: the graph is specialized on it
            return self.forward(input_ids=fresh, cache=cache, use_cache=True, logits_to_keep=1).logits.clone()


def use_step(model, kind: str) -> None:
    """Make `pair.open_context` give `model` contexts of this kind. What a kind needs (the pool of static caches, the
    compiled step) is made once per model and kept as instance attributes, so the model's class is untouched."""
    if kind not in KINDS:
        raise ValueError(f"unknown step kind {kind!r}; one of {', '.join(KINDS)}")
    state = model.__dict__
    state.pop("new_context", None)
    state["step_kind"] = kind
    if kind == "dynamic":
        return
    pool = state.setdefault("static_caches", CachePool(model.config))
    step = None
    if kind == "compiled":
        if "compiled_step" not in state:
            state["compiled_step"] = CompiledStep(
                model, "reduce-overhead" if model.device.type == "cuda" else "default"
            )
        step = state["compiled_step"]
    state["new_context"] = lambda ids: StaticContext(model, ids, pool, step)


def step_kind(model) -> str:
    return model.__dict__.get("step_kind", "dynamic")


@torch.inference_mode()
def time_kind(model, kind: str) -> dict:
    """Seconds of a one-token step and of a VERIFY_ROWS-token verify after a PROMPT-token prompt (the fastest of
    REPEATS each, the cache rolled back after each), and of the first step (which compiles)."""
    use_step(model, kind)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(0)
    ctx = open_context(model, torch.randint(vocab, (PROMPT,), generator=g).tolist())
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


def choose_step(model, model_name: str, precision: str, cache_dir: Path | None, log=print) -> str:
    """The fastest kind for this model on this machine, measured once (a failing kind, such as a compile that
    breaks, is skipped and said), then read from the cache; `model` is set to use it."""
    if not supports(model):
        log(f"{model_name}: decoding on transformers' own cache (its layers need it: sliding window or recurrent)")
        return "dynamic"
    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    known = read_choices(cache)
    key = f"{machine_key(model)}|{model_name}|{precision}"
    if key not in known:
        known[key] = measure_kinds(model, model_name, log)
        write_choices(cache, known)
    choice = known[key]
    kind = choice["kind"]
    first = time_kind(model, kind)["first_s"]  # sets the model to it; a step compiles now, not in the first answer
    timings = ", ".join(f"{k} {t['step_s'] * 1e3:.1f}/{t['verify_s'] * 1e3:.1f} ms" for k, t in choice["timed"].items())
    log(
        f"{model_name}: decoding steps {kind} (measured here, one-token step/{VERIFY_ROWS}-token verify: {timings}; "
        f"first step now {first:.2f} s)"
    )
    return kind


def measure_kinds(model, model_name: str, log) -> dict:
    timed = {}
    for kind in KINDS:
        try:
            timed[kind] = time_kind(model, kind)
        except Exception as e:  # a kind that fails on this model (a compile that breaks) is not a failed load
            log(f"{model_name}: {kind} decoding steps do not run here ({type(e).__name__}: {e}); not used")
    use_step(model, "dynamic")
    return {"kind": best_kind(timed), "timed": timed}


def best_kind(timed: dict) -> str:
    """The kind with the least step + verify time, if it beats transformers' own cache by the margin."""
    cost = {k: t["step_s"] + t["verify_s"] for k, t in timed.items()}
    if "dynamic" not in cost:
        return "dynamic"
    best = min(cost, key=lambda kind: cost[kind])
    return best if cost[best] < MARGIN * cost["dynamic"] else "dynamic"
