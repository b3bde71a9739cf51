"""A model's twin: a second copy of its GGUF with its weights in llama.cpp's AMX buffer, which computes the positions
`kernels.py` puts on the prefill kernels (a prompt, a drafter's catch-up) on the AMX tiles, where the CPU has them.

Why a copy: on a CPU with AMX the tiles multiply a batch of many rows faster than the repacked weights' gemm, but one
row through them is slower than the one-row kernel of plain steps and verifies, and the AMX buffer keeps the weights
in a layout of its own (docs/benchmarks.md, "Prompts on AMX tiles"). So the model keeps its repacked weights for the
row kernels and the twin holds the same weights in the AMX layout for the prefill kernels: the weights and a KV cache
twice in memory, for prompts read faster.

How: a call on the prefill kernels moves the calling cache's sequence (its keys and values, bit for bit) into the
twin's context, decodes there and moves the sequence back. Lossless holds as before: which kernels compute a position
is `Batching.kernels`' choice, and in a model with a twin every position on the prefill kernels is the twin's. The
twin's rows get the same bits in any batch (its kernels sum each row on its own: int32 sums, then the same float steps
for every row), so a refeed that cuts a prefill run anew gets them again; `row_gap` measures that at load, and a twin
whose rows differ is dropped for the process."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .binding import amx_weights, last_errors
from .cache import CacheOwner, LlamaCache

CHECK_ROWS = 8
"""Rows the load check compares, one call against single steps, after as many positions again."""


class Twin:
    """The twin's model and its one context, shared by the model's caches, one call at a time."""

    def __init__(self, owner: CacheOwner, model_params):
        """The owner's GGUF loaded again with its weights in the AMX buffer, and a context for it with the owner's
        settings. The owner frees `model`, after the context."""
        lib, path = owner.lib, owner.path
        self._lib = lib
        with amx_weights():
            self.model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load a second copy of {path.name}{last_errors()}")
        try:
            self.cache = LlamaCache(owner, self.model)
        except Exception:  # the caller has not taken the model yet: nothing else would free it
            lib.llama_model_free(self.model)
            raise
        self._lock = threading.Lock()

    def decode(self, cache: LlamaCache, tokens: list[int], pos0: int, n_out: int) -> list[np.ndarray]:
        """`cache`'s llama_decode call of `tokens` at `pos0`, computed by the twin: the logits of the last `n_out`."""
        with self._lock:
            self.cache.set_threads(cache.threads)
            _move_sequence(self._lib, cache, self.cache, pos0)
            rows = self.cache.decode(tokens, pos0, n_out)
            try:
                _move_sequence(self._lib, self.cache, cache, pos0 + len(tokens))
            except RuntimeError:
                cache.keep_first(0)  # its positions are gone: it says so, and its next user feeds them afresh
                cache.owner = None
                raise
        return rows

    def row_gap(self, n_vocab: int) -> float:
        """The largest logit difference between CHECK_ROWS positions computed in one call and one at a time."""
        ids = [(7 * i + 1000) % n_vocab for i in range(2 * CHECK_ROWS)]
        head, tail = ids[:CHECK_ROWS], ids[CHECK_ROWS:]
        with self._lock:
            c = self.cache
            c.drop_memory()
            c.decode(head, 0, 0)
            together = np.stack(c.decode(tail, CHECK_ROWS, CHECK_ROWS))
            c.drop_memory()
            c.decode(head, 0, 0)
            alone = np.stack([c.decode([t], CHECK_ROWS + i, 1)[0] for i, t in enumerate(tail)])
            c.drop_memory()
        return float(np.abs(together - alone).max())


def _move_sequence(lib, src: LlamaCache, dst: LlamaCache, n: int) -> None:
    """Make `dst`'s llama.cpp context hold `src`'s first n positions, their keys and values copied bit for bit (src
    holds exactly n)."""
    dst.drop_memory()
    if not n:
        return
    size = lib.llama_state_seq_get_size(src.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    if lib.llama_state_seq_get_data(src.ctx, buf, size, 0) != size:
        raise RuntimeError(f"llama.cpp could not copy {n} cached positions out of a context{last_errors()}")
    if lib.llama_state_seq_set_data(dst.ctx, buf, size, 0) != size:
        dst.drop_memory()
        raise RuntimeError(f"llama.cpp could not copy {n} cached positions into a context{last_errors()}")
