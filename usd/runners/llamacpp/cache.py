"""One llama.cpp context of a model: a KV cache, the ids it holds and which kernels computed them, and the one place
where ids reach llama.cpp's C buffers (`decode`), each call checked first."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...errors import InternalError
from .binding import last_errors, threadpools
from .kernels import N_BATCH, ROW, Batching, Kernel

N_OUTPUTS = 32
"""Rows of logits one llama_decode call may return (llama.cpp keeps a buffer of this many rows of the vocabulary)."""


class CacheUser(Protocol):
    """What a cache follows: a decoding context's ids, and the cache it last used (`context.LlamaCppContext`)."""

    ids: list[int]
    cache: LlamaCache | None


class PrefillTwin(Protocol):
    """Where a cache's calls on the prefill kernels run, when its model has a twin (`twin.Twin`)."""

    def decode(self, cache: LlamaCache, tokens: list[int], pos0: int, n_out: int) -> list[np.ndarray]: ...


class CacheOwner(Protocol):
    """What a cache takes from the model it belongs to (`model.LlamaCppModel`)."""

    lib: Any
    params: Any
    """llama.cpp's context parameters, the same for every cache of the model."""
    handles: list
    """Each cache's llama.cpp context and batch, for the owner to free."""
    n_vocab: int
    batching: Batching
    path: Path


class LlamaCache:
    """A KV cache, the ids it holds and what computed them, and the decoding context whose ids it follows.
    llama.cpp's context is not thread-safe: one generation uses it at a time (`pool.CachePool.borrow`)."""

    def __init__(self, owner: CacheOwner, model, twin: PrefillTwin | None = None):
        """A context of the llama.cpp `model` (the owner's, or its twin's) with the owner's settings; the owner frees
        it (its `handles`)."""
        lib, params, path = owner.lib, owner.params, owner.path
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}{last_errors()}")
        pools = threadpools()
        try:
            free_pool = pools.attach_new(ctx, params.n_threads) if pools is not None else None
        except Exception:  # the context is in no handle yet: nothing else would free it
            lib.llama_free(ctx)
            raise
        batch = lib.llama_batch_init(N_BATCH, 0, 1)
        owner.handles.append((ctx, batch, free_pool))
        self._lib, self.ctx, self._batch, self._mem = lib, ctx, batch, lib.llama_get_memory(ctx)
        self.n_ctx, self.n_vocab, self.batching, self.path = lib.llama_n_ctx(ctx), owner.n_vocab, owner.batching, path
        self.twin = twin
        """Where the calls on the prefill kernels run, when the model has a twin (twin.py)."""
        self.threads = params.n_threads
        self.kv: list[int] = []
        """The ids whose keys and values the cache holds, at positions 0..len-1."""
        self.kv_kernels: list[Kernel] = []
        """What computed each cached position (see `context.LlamaCppContext.kernels`)."""
        self.owner: CacheUser | None = None
        """The decoding context whose ids the cache follows; another one first keeps only what they share."""
        self.busy = False
        """A forward is using it (`pool.CachePool.borrow`)."""

    def set_threads(self, n: int) -> None:
        self._lib.llama_set_n_threads(self.ctx, n, n)
        self.threads = n

    def drop_memory(self) -> None:
        """Empty llama.cpp's cache, leaving what `kv` says to the caller (twin.py moves a sequence through it)."""
        self._lib.llama_memory_seq_rm(self._mem, 0, 0, -1)

    def keep_first(self, n: int) -> None:
        """Drop the cached positions from n on (sequence removal: the cache's own rollback)."""
        if len(self.kv) > n:
            if not self._lib.llama_memory_seq_rm(self._mem, 0, n, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {n}.. from its cache{last_errors()}")
            del self.kv[n:]
            del self.kv_kernels[n:]

    def feed(self, tokens: list[int], n_out: int, kernels: Kernel | list[Kernel] = ROW) -> np.ndarray:
        """Evaluate `tokens` at the positions after the cache; return the logits of the last `n_out` as [n_out, V].
        `kernels` (for all or for each token) says which kernels compute it, in the calls the model's `batching`
        cuts for them."""
        # the decode loop and the API keep a generation inside the context and feed only ids its tokenizer made:
        # anything else here is a bug, and must not reach llama.cpp's buffers
        if len(self.kv) + len(tokens) > self.n_ctx:
            raise InternalError(
                f"{self.path.name}: {len(self.kv) + len(tokens):,} positions do not fit the llama.cpp "
                f"context of {self.n_ctx:,}"
            )
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.n_vocab:
            raise InternalError(f"{self.path.name}: a token id outside its vocabulary of {self.n_vocab:,}")
        kinds = [kernels] * len(tokens) if isinstance(kernels, int) else list(kernels)
        n_out = min(n_out, len(tokens))
        first_out = len(tokens) - n_out
        rows: list[np.ndarray] = []
        for start, end in self.batching.calls(kinds):
            outs = max(0, end - max(first_out, start))
            if outs > self.batching.row_batch:  # the last layer runs on the rows read: on the row kernels
                raise InternalError(f"{outs} rows of logits from one prefill batch (at most {self.batching.row_batch})")
            if self.twin is not None and kinds[start] != ROW:  # a call on the prefill kernels: the twin's
                rows.extend(self.twin.decode(self, tokens[start:end], len(self.kv), outs))
            else:
                rows.extend(self.decode(tokens[start:end], len(self.kv), outs))
            self.kv.extend(tokens[start:end])
            self.kv_kernels.extend(kinds[start:end])
        return np.stack(rows) if rows else np.empty((0, self.n_vocab), dtype=np.float32)

    def decode(self, tokens: list[int], pos0: int, n_out: int) -> list[np.ndarray]:
        """One llama_decode call of `tokens` at positions from `pos0`: the logits of the last `n_out`."""
        n = len(tokens)
        if not 0 < n <= N_BATCH or not 0 <= n_out <= min(n, N_OUTPUTS):  # the C arrays hold N_BATCH entries
            raise InternalError(f"a llama_decode call of {n} tokens and {n_out} rows of logits")
        lib, b = self._lib, self._batch
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= n - n_out
        rc = lib.llama_decode(self.ctx, b)
        if rc != 0:
            # the cache may hold part of the batch now: forget it, so the next feed starts from what is known
            lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)
            raise RuntimeError(f"llama_decode failed ({rc}) on {n} tokens at position {pos0}{last_errors()}")
        rows = []
        for i in range(n - n_out, n):
            ptr = lib.llama_get_logits_ith(self.ctx, i)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no logits for batch row {i}{last_errors()}")
            rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())  # the next decode reuses it
        return rows


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n, limit = 0, min(len(a), len(b), limit)
    while n < limit and a[n] == b[n]:
        n += 1
    return n
