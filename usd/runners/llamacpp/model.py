"""A model's GGUF file run as it is (its own quantized weights) by llama.cpp, through llama-cpp-python's low-level
API: the model, its llama.cpp contexts (`pool.py`) and the decoding contexts it opens (`context.py`), which keep every
position on the kernels `kernels.py` chooses."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import OwnRunner, cpu_threads
from .binding import (
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    amx_prefill,
    amx_prefill_off,
    amx_prefill_why,
    exact_rows,
    exact_rows_off,
    exact_rows_why,
    last_errors,
    library,
    threads_why,
)
from .cache import N_OUTPUTS, LlamaCache
from .context import LlamaCppContext
from .kernels import N_BATCH, ROW, Batching, Kernel
from .pool import MAX_CACHES, CachePool
from .twin import Twin

N_CTX_CAP = 8192
"""The most positions a llama.cpp context gets (the catalog's context length, capped for memory)."""
KV_PAD = 256
"""llama.cpp pads the attended cache to a multiple of this; n_ctx is one too, so the padding is never cut short."""


@dataclass
class GGUFConfig:
    """What the rest of the project reads of a model's config."""

    max_position_embeddings: int
    """The llama.cpp context's size (n_ctx): the most positions this runner takes."""
    vocab_size: int
    n_ctx_train: int


class LlamaCppModel(OwnRunner):
    """A GGUF loaded by llama.cpp; it is its own runner (`new_context`)."""

    device = torch.device("cpu")
    dtype = torch.float32
    """The logits' dtype (the weights stay in their GGUF quantization)."""

    def __init__(
        self,
        path: str | Path,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        generation_config=None,
        name: str | None = None,
        repacked_weights: bool = True,
        **context_params,
    ):
        lib = library()
        self.path = Path(path)
        self.name_or_path = name or self.path.stem
        self.generation_config = generation_config
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        # repacked weights, as llama.cpp loads them by default: their gemv serves our row batches (kernels.py)
        mp.use_extra_bufts = repacked_weights
        self.batching = Batching.for_weights(repacked_weights, exact_rows())
        model = lib.llama_model_load_from_file(str(self.path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.path}{last_errors()}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        n_train = lib.llama_model_n_ctx_train(model)
        n_ctx = min(n_ctx or N_CTX_CAP, N_CTX_CAP, n_train if n_train > 0 else N_CTX_CAP)
        n_ctx = max(KV_PAD, n_ctx // KV_PAD * KV_PAD)
        threads = n_threads or cpu_threads()
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_seq_max = 1
        cp.n_outputs_max = N_OUTPUTS
        cp.n_threads = cp.n_threads_batch = threads
        # flash attention with a bf16 V cache beside the f16 K cache: the one-row kernel for any batch (kernels.py)
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k, cp.type_v = GGML_TYPE_F16, GGML_TYPE_BF16
        cp.no_perf = True
        for key, value in context_params.items():  # overrides, for measurements (they may break batch invariance)
            setattr(cp, key, value)
        self.lib, self._model, self.params = lib, model, cp
        """llama.cpp's functions, the model, and the parameters of each context (cache) of it."""
        self.handles: list = []
        """Each cache's llama.cpp context and batch, freed before the models."""
        self._models = [model]
        """The llama.cpp models: this one, and its twin's if it has one."""
        self._finalizer = weakref.finalize(self, _free, lib, self._models, self.handles)
        self.n_threads = threads
        mp.use_extra_bufts = True  # for the twin: the AMX buffer is one of llama.cpp's extra buffer types
        self.twin = self._load_twin(mp) if amx_prefill() else None
        self.pool = CachePool(self._new_cache, threads, MAX_CACHES)  # (a test may lower pool.max_caches)
        self.n_ctx = self.pool.caches[0].n_ctx
        self.config = GGUFConfig(max_position_embeddings=self.n_ctx, vocab_size=self.n_vocab, n_ctx_train=n_train)
        if self.batching.exact_rows and not _exact_rows_checked:
            self._check_rows(repacked_weights)

    def _check_rows(self, repacked: bool) -> None:
        """The patch's rows checked once a process, on the first model loaded: a verify of a whole row batch against
        as many single steps. Rows that differ (a CPU where the kernels' premises fail) turn exact rows off for the
        process, and this model takes the unpatched rule; a model loaded later reads the verdict."""
        global _exact_rows_checked
        _exact_rows_checked = True
        n = self.batching.row_batch
        ids = [(7 * i + 1000) % self.n_vocab for i in range(2 * n)]
        with self.pool.lock:
            gap = row_gaps(self, ids, [n])[n]
        if gap != 0.0:
            exact_rows_off(f"its rows differed from single steps by {gap:.3g} logits on this CPU at load")
            self.batching = Batching.for_weights(repacked)
            for cache in self.pool.caches:
                cache.batching = self.batching

    def _load_twin(self, model_params) -> Twin | None:
        """A twin for the calls on the prefill kernels (twin.py), or None where it does not load or, checked once a
        process on the first twin, its rows are not the same bits in every batch (no twins then)."""
        global _twin_checked
        try:
            twin = Twin(self, model_params)
        except RuntimeError as e:
            amx_prefill_off(f"a second copy of the weights for the AMX tiles did not load ({e})")
            return None
        self._models.append(twin.model)
        if not _twin_checked:
            _twin_checked = True
            gap = twin.row_gap(self.n_vocab)
            if gap != 0.0:
                amx_prefill_off(f"the AMX tiles' rows differed by {gap:.3g} logits between batches on this CPU at load")
                return None
        return twin

    @property
    def rule(self) -> str:
        """The exactness rule and how prompts are read, in words, for the load line."""
        prompts = "; prompts read on AMX tiles, by a second copy of the weights" if self.twin is not None else ""
        return f"{self.batching.rule}{self.rule_why}{prompts}"

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.path.name}, n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, threads={self.n_threads})"

    @property
    def rule_why(self) -> str:
        """Why the unpatched rule runs, what the build's threads cost and why no twin reads the prompts where the CPU
        has AMX (": ..."), or nothing."""
        no_twin = "" if self.twin is not None else amx_prefill_why()
        whys = [why for why in ("" if self.batching.exact_rows else exact_rows_why(), threads_why(), no_twin) if why]
        return f": {'; '.join(whys)}" if whys else ""

    def new_context(self, ids: list[int]) -> LlamaCppContext:
        return LlamaCppContext(self.batching, self.pool, ids)

    def close(self) -> None:
        self._finalizer()

    def _new_cache(self) -> LlamaCache:
        return LlamaCache(self, self._model, self.twin)

    def forget(self) -> None:
        self.pool.forget()

    def cpu_threads(self) -> int:
        return self.n_threads

    # --- the first cache, for measurements and tests that drive llama.cpp directly ----------------------------------

    @property
    def kv(self) -> list[int]:
        return self.pool.caches[0].kv

    def keep_first(self, n: int) -> None:
        self.pool.caches[0].keep_first(n)

    def feed(self, tokens: list[int], n_out: int, kernels: Kernel | list[Kernel] = ROW) -> np.ndarray:
        return self.pool.caches[0].feed(tokens, n_out, kernels)


def row_gaps(model: LlamaCppModel, ids: list[int], sizes: list[int]) -> dict[int, float]:
    """For each n in `sizes`: the largest logit difference between n positions after `ids` evaluated one at a time
    and together, as a verify of n - 1 drafted tokens is (0.0: none). The positions follow on from `ids`; the cache
    holds `ids` once for all sizes, and is left empty."""
    model.forget()
    head, tail = ids[: -max(sizes)], ids[-max(sizes) :]
    model.feed(head, 0, model.batching.kernels([], len(head), 0))
    single = np.concatenate([model.feed([t], 1) for t in tail])
    gaps = {}
    for n in sizes:
        model.keep_first(len(head))
        gaps[n] = float(np.abs(single[:n] - model.feed(tail[:n], n)).max())
    model.forget()
    return gaps


_exact_rows_checked = False
"""Whether a model of this process checked the patch's rows at load (`LlamaCppModel._check_rows`)."""
_twin_checked = False
"""Whether a twin of this process checked its rows at load (`LlamaCppModel._load_twin`)."""


def _free(lib, models: list, handles: list) -> None:
    for ctx, batch, free_pool in handles:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        if free_pool is not None:  # after its context, which may still point to it
            free_pool()
    for model in models:
        lib.llama_model_free(model)
