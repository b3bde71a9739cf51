"""A model's token ids and its share of the model's llama.cpp caches: the llama.cpp runner's decoding context."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..kept import KeptLogits
from .cache import LlamaCache, common_prefix
from .kernels import Batching, Kernel

if TYPE_CHECKING:
    from .pool import CachePool


class LlamaCppContext:
    def __init__(self, batching: Batching, pool: CachePool, ids: list[int]):
        self.batching, self.pool = batching, pool
        """The model's exactness rule and its caches (`model.LlamaCppModel`)."""
        self.ids = list(ids)
        self.kernels: list[Kernel] = batching.kernels([], len(self.ids), 1)
        """What computes each of the first len(kernels) ids (`kernels.Batching.kernels`): the prompt's decided here,
        from the prompt alone; ids added later get theirs at their first forward."""
        self.cache: LlamaCache | None = None
        """The cache this context last used."""
        self.cached = 0
        """How many of `ids` that cache holds (while this context owns it)."""
        self.forward_s = 0.0
        """Seconds spent inside model forwards."""
        self.last = KeptLogits()

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        self.last.drop_from(n)
        self.kernels = self.batching.whole_runs(self.kernels[:n])
        self.cached = min(self.cached, len(self.kernels))
        self.pool.release_rows(self, self.cached)

    def _claim(self, cache: LlamaCache) -> None:
        """Own `cache`, keeping what it holds of our ids computed by our kernels."""
        if cache is self.cache and cache.owner is self:
            return
        n = common_prefix(self.ids, cache.kv, limit=len(self.kernels))
        same = (a == b for a, b in zip(cache.kv_kernels[:n], self.kernels[:n], strict=True))
        self.cached = next((i for i, ok in enumerate(same) if not ok), n)
        self.cache, cache.owner = cache, self

    @torch.inference_mode()
    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` of them (0: all) as [n, V] float32.
        The first of them may be the last position fed, kept (`KeptLogits`): a prompt's last position, which only its
        whole prompt batch computes again."""
        t0 = time.perf_counter()
        with self.pool.borrow(self) as cache:  # llama.cpp contexts are not thread-safe: one user each at a time
            self._claim(cache)
            held, n_out = self.last.take(len(self.ids), max(keep or len(self.ids) - self.cached, 1))
            if not n_out:
                return self.last.joined(held, None, len(self.ids))
            batching = self.batching
            self.kernels = batching.kernels(self.kernels, len(self.ids), n_out)
            # Logits are only had by feeding: when the cache already holds positions asked for (the last one, again;
            # or positions another context fed, sharing the model), they are fed again (same kernels, same bits).
            self.cached = batching.refeed_from(self.kernels, min(self.cached, len(self.ids) - n_out))
            cache.keep_first(self.cached)
            logits = cache.feed(self.ids[self.cached :], n_out, self.kernels[self.cached : len(self.ids)])
            self.cached = len(self.ids)
        self.forward_s += time.perf_counter() - t0
        return self.last.joined(held, torch.from_numpy(logits), len(self.ids))
