"""Static caches for a transformers model's decoding steps on a GPU: a preallocated cache (`StaticContext`) reused
from a per-model pool, and the one-token step compiled (`CompiledStep`: CUDA graphs replay the whole step as one
launch, where a small model's step is mostly launches); beside transformers' own growing cache (`context.Context`),
the kinds `steps.py` times at load. A verify of k + 1 rows stays eager, since each k would compile its own graph.

Lossless: every kind gives the same tokens for the same logits. The compiled step and an eager verify row sum in
different orders, so their logits differ by rounding; greedy identity then holds up to the near-ties docs/design.md
§8 describes for bf16 and 4-bit models on a GPU.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .context import Context

KINDS = ("dynamic", "static", "compiled")
"""The kinds of decoding steps: transformers' own cache, a static one, a static one with the step compiled."""
MIN_POSITIONS = 512
"""A static cache's first size. It doubles when a context outgrows it (copying what it holds, so no position is
computed twice), and each size compiles the step once per process."""


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
