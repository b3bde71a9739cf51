"""The llama.cpp runner: a model's GGUF file run as it is (its own quantized weights) through llama-cpp-python's
low-level API, behind the decoding-context interface the decode loop drives (`pair.Context`): `ids`, `forward(keep)`,
`truncate(n)`, `forward_s`, `matched`, `cached`.

Lossless needs a position's logits to be the same bits whenever it is evaluated: alone (plain decoding, a drafter
step), inside a verify batch, or again after a rollback or after another generation displaced it from the cache.
llama.cpp's CPU backend picks kernels by batch size, and some sum in another order than the one-row kernels. Measured
(llama-cpp-python 0.3.36, the registry's GGUFs; `batch_invariance`), before the settings below: 0.3-1.1 logits apart.

- Attention: without flash attention, KQ and KQV are matmuls against the f16 cache, which llamafile's tinyBLAS serves
  for two queries or more and vec_dot for one. With flash attention and an f16 cache, one query over 512 cached
  positions or more takes a split-KV kernel and 64 queries or more a tiled one. So: flash attention on, with a bf16 V
  cache beside the f16 K cache, which keeps every batch on the one-row kernel (it skips masked positions, so the
  cache's padding does not matter either). 0.0 at every length and batch tried.
- tinyBLAS also serves the Q8_0/Q5_0 weights of these GGUFs at two rows or more; on this CPU it gives vec_dot's bits.
  Should another CPU differ, tests/test_llamacpp.py says so, and -DGGML_LLAMAFILE=OFF in CMAKE_ARGS is the fix.

The matmuls remain, and two families of kernels with them. Each family on its own gives a row the same bits in any
batch it serves, but the two sum in different orders:
- with repacked weights (the "extra buffer types": interleaved Q4_0 and Q4_K for AVX2, not Q6_K there;
  llama.cpp's default, and ours: decoding 28% faster here) a batch of 4 rows or more runs whole groups of GEMM_ROWS (4)
  through a gemm kernel and the rest row by row through gemv: row batches of at most 3 rows; the matrices not repacked
  (Q6_K, Q8_0...) take the plain-weight kernels below, by batch size;
- with plain weights (`repacked_weights=False`) the tiled K-quant matmul takes batches of PREFILL_MIN_ROWS (8) or more
  and vec_dot smaller ones (reading a prompt 2.7x faster than vec_dot, 1.5x faster than the repacked gemm): row
  batches of at most 7 rows, prefill batches of 8 or more. `Batching` holds each geometry.
So the runner fixes, once, which kernels compute each position:
  * a prompt, its last token included, in one prefill run, as llama.cpp's own generate reads it (its last token's
    logits choose the first token, kept for round 0: `pair.LastLogits`): whole gemm groups (PREFILL), then the 0-3
    rows left (TAIL: gemv for the repacked matrices, the prefill kernels for the others) in the same batch; so its
    answer's tokens are those llama.cpp's generate gives with the same attention settings
    (scripts/check_llamacpp_reference.py), but for the prompt lengths llama.cpp reads in batches of other kernels
    (docs/design.md §8); a prompt too short for a prefill batch on the row kernels;
  * everything after it whose logits are read (verified drafts, the target's own tokens, a drafter's steps) on the row
    kernels: a verify longer than a row batch takes several llama_decode calls; what a drafter catches up on without
    reading logits, on the prefill kernels again as far as they reach;
  * a position keeps its kernels for good: each context records them (`LlamaCppContext.kernels`), the cache records
    what computed what it holds, and a context reuses only cached positions its own kernels computed, so a position
    re-fed after a rollback or a displacement gets its bits again.
  A prompt's kernels depend on the prompt alone, never on what the cache or an earlier turn held: a chat's next turn
  reads its whole conversation as one prompt, as it would from an empty cache (reusing the cached positions that
  prompt computes on the same kernels: the earlier prompt's whole gemm groups), so its bits do not depend on which
  algorithm ran the turns before, on what they fed past their answers, or on whether the cache still holds them. So
  plain decoding and every algorithm compute every position of every turn on the same kernels
  (tests/test_llamacpp.py).

A model has one llama.cpp context (`LlamaCache`, a KV cache), and one more for each generation that runs while all
the others are busy (the server's slots), up to MAX_CACHES. A forward takes its generation's cache back if it is free,
else the free one that costs least to reuse, so a conversation is not displaced by another while a cache of its own is
to be had.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import InternalError
from .pair import LastLogits

N_CTX_CAP = 8192
"""The most positions a llama.cpp context gets (the catalog's context length, capped for memory)."""
N_BATCH = 512
"""The most tokens per llama_decode call (prefills go in near-equal batches of at most this)."""
PREFILL_MIN_ROWS = 8
"""llama.cpp's tiled K-quant matmul takes batches of this many rows or more (ggml-cpu/tiled/tiled.cpp) and sums in
another order than the row kernels below it; see the module docstring."""
GEMM_ROWS = 4
"""Repacked weights multiply a batch of 4 rows or more in groups of this many (gemm), the rest row by row (gemv)."""
ROW, PREFILL, TAIL = 0, 1, 2
"""What computes a position (module docstring):
- ROW: the row kernels (an answer's tokens, drafts, a verify; a prompt too short for a prefill batch);
- PREFILL: the prefill kernels (a prompt, in whole gemm groups with repacked weights);
- TAIL: the rows of a prefill batch after its last whole gemm group (repacked weights only; the 0-3 last positions of a
  prompt): gemv for the repacked matrices, the prefill kernels for the others (Q6_K on AVX2)."""
MAX_CACHES = 4
"""The most llama.cpp contexts (KV caches, n_ctx positions each) a model opens for generations running at once."""
N_OUTPUTS = 32
"""Rows of logits one llama_decode call may return (llama.cpp keeps a buffer of this many rows of the vocabulary)."""
KV_PAD = 256
"""llama.cpp pads the attended cache to a multiple of this; n_ctx is one too, so the padding is never cut short."""

GGML_TYPE_F16, GGML_TYPE_BF16 = 1, 30  # ggml.h's enum ggml_type (the binding names no BF16)
BUILD_ARGS = (
    "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF"
)
INSTALL_HINT = (
    "precision gguf runs the model's GGUF on llama.cpp, through llama-cpp-python, which is not installed. It builds "
    "llama.cpp from source (about 6 minutes on two idle cores): "
    f'CMAKE_ARGS="{BUILD_ARGS}" pip install "usd-chat[llamacpp]" '
    "(./dev.sh setup does this). Or choose --precision fp32 / bf16 to run the model on transformers."
)


class LlamaCppUnavailable(ImportError):
    """llama-cpp-python is not installed (or its library does not load); the message says how to install it."""


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


_lock = threading.Lock()
_state: dict = {}


def _lib():
    """llama_cpp, with the backend initialised and its log quieted (errors are kept for our messages)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        try:
            import llama_cpp
        except (ImportError, OSError) as e:
            raise LlamaCppUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
        errors: list[str] = []

        @llama_cpp.llama_log_callback
        def log(level, text, user_data):
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                errors.append(text.decode("utf-8", "replace").strip())
                del errors[:-5]

        llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _state.update(lib=llama_cpp, log=log, errors=errors)  # the callback must outlive every call into llama.cpp
        return llama_cpp


def _last_errors() -> str:
    errors = _state.get("errors") or []
    return f": {' / '.join(errors)}" if errors else ""


def cpu_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


@dataclass
class GGUFConfig:
    """What the rest of the project reads of a model's config."""

    max_position_embeddings: int
    """The llama.cpp context's size (n_ctx): the most positions this runner takes."""
    vocab_size: int
    n_ctx_train: int
    model_type: str = "gguf"

    def get_text_config(self, *args, **kwargs):
        return self


class LlamaCppModel:
    """A GGUF loaded by llama.cpp, with its llama.cpp contexts (`LlamaCache`: a KV cache each): one, and one more for
    each generation that runs while all the others are busy (the server's slots), up to `max_caches`."""

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
        max_caches: int = MAX_CACHES,
        **context_params,
    ):
        lib = _lib()
        self.path = Path(path)
        self.name_or_path = name or self.path.stem
        self.generation_config = generation_config
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        # repacked weights, as llama.cpp loads them by default: their gemv serves our row batches (module docstring)
        mp.use_extra_bufts = repacked_weights
        self.batching = Batching.for_weights(repacked_weights)
        model = lib.llama_model_load_from_file(str(self.path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.path}{_last_errors()}")
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
        # flash attention with a bf16 V cache beside the f16 K cache: the one-row kernel for any batch (see above)
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k, cp.type_v = GGML_TYPE_F16, GGML_TYPE_BF16
        cp.no_perf = True
        for key, value in context_params.items():  # overrides, for measurements (they may break batch invariance)
            setattr(cp, key, value)
        self._lib, self._model, self._params = lib, model, cp
        self._handles: list = []
        """Each cache's llama.cpp context and batch, freed before the model."""
        self._finalizer = weakref.finalize(self, _free, lib, model, self._handles)
        self.n_threads = threads
        self.caches = [self._new_cache()]
        """The model's llama.cpp contexts: the first for everything done one at a time, more for generations at once."""
        self.max_caches = max_caches
        self.n_ctx = self.caches[0].n_ctx
        self.config = GGUFConfig(max_position_embeddings=self.n_ctx, vocab_size=self.n_vocab, n_ctx_train=n_train)
        self.lock = threading.Condition(threading.RLock())
        """Guards which generation uses which cache; a cache's user decodes without it."""

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.path.name}, n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, threads={self.n_threads})"

    def new_context(self, ids: list[int]) -> LlamaCppContext:
        with self.lock:
            return LlamaCppContext(self, ids)

    def close(self) -> None:
        self._finalizer()

    def _new_cache(self) -> LlamaCache:
        return LlamaCache(self._lib, self._model, self._params, self._handles, self.n_vocab, self.batching, self.path)

    @contextlib.contextmanager
    def borrow(self, user: LlamaCppContext) -> Iterator[LlamaCache]:
        """A cache for `user`'s forward, for it alone (`_pick`). Generations at once share the cores (llama.cpp's bits
        do not depend on the thread count: tests/test_llamacpp.py)."""
        with self.lock:
            while (cache := self._pick(user)) is None:
                self.lock.wait()
            cache.busy = True
            cache.set_threads(max(1, self.n_threads // sum(c.busy for c in self.caches)))
        try:
            yield cache
        finally:
            with self.lock:
                cache.busy = False
                self.lock.notify_all()

    def _pick(self, user: LlamaCppContext) -> LlamaCache | None:
        """`user`'s own cache if free; a new one if none is free and there is room; else the free one that costs
        least: what it lacks of `user`'s ids, plus what it holds that they do not share (another conversation's
        positions, which it would have to re-feed). None: wait."""
        free = [c for c in self.caches if not c.busy]
        mine = next((c for c in free if c.owner is user), None)
        if mine is not None:
            return mine
        if not free and len(self.caches) < self.max_caches:
            try:
                self.caches.append(self._new_cache())
                return self.caches[-1]
            except RuntimeError:  # no memory for another: the generations take turns on those there are
                self.max_caches = len(self.caches)
        return max(free, key=lambda c: 2 * _common_prefix(user.ids, c.kv, len(c.kv)) - len(c.kv), default=None)

    # --- the cache -------------------------------------------------------------------------------------------------

    def forget(self) -> None:
        """Empty the caches: the next context computes everything afresh, with the bits it would get anyway.
        (Between generations: measurements, `usd bench`.)"""
        with self.lock:
            for cache in self.caches:
                cache.owner = None
                cache.keep_first(0)

    # --- the first cache, for measurements and tests that drive llama.cpp directly ----------------------------------

    @property
    def kv(self) -> list[int]:
        return self.caches[0].kv

    def keep_first(self, n: int) -> None:
        self.caches[0].keep_first(n)

    def feed(self, tokens: list[int], n_out: int, kernels: int | list[int] = ROW) -> np.ndarray:
        return self.caches[0].feed(tokens, n_out, kernels)


class LlamaCache:
    """One llama.cpp context of a model: a KV cache, the ids it holds and what computed them, and the decoding context
    whose ids it follows. llama.cpp's context is not thread-safe: one generation uses it at a time
    (`LlamaCppModel.borrow`)."""

    def __init__(self, lib, model, params, handles: list, n_vocab: int, batching: Batching, path: Path):
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}{_last_errors()}")
        batch = lib.llama_batch_init(N_BATCH, 0, 1)
        handles.append((ctx, batch))
        self._lib, self._ctx, self._batch, self._mem = lib, ctx, batch, lib.llama_get_memory(ctx)
        self.n_ctx, self.n_vocab, self.batching, self.path = lib.llama_n_ctx(ctx), n_vocab, batching, path
        self.kv: list[int] = []
        """The ids whose keys and values the cache holds, at positions 0..len-1."""
        self.kv_kernels: list[int] = []
        """What computed each cached position (ROW, PREFILL or TAIL: see `LlamaCppContext.kernels`)."""
        self.owner: LlamaCppContext | None = None
        """The decoding context whose ids the cache follows; another one first keeps only what they share."""
        self.busy = False
        """A forward is using it (`LlamaCppModel.borrow`)."""

    def set_threads(self, n: int) -> None:
        self._lib.llama_set_n_threads(self._ctx, n, n)

    def keep_first(self, n: int) -> None:
        """Drop the cached positions from n on (sequence removal: the cache's own rollback)."""
        if len(self.kv) > n:
            if not self._lib.llama_memory_seq_rm(self._mem, 0, n, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {n}.. from its cache{_last_errors()}")
            del self.kv[n:]
            del self.kv_kernels[n:]

    def feed(self, tokens: list[int], n_out: int, kernels: int | list[int] = ROW) -> np.ndarray:
        """Evaluate `tokens` at the positions after the cache; return the logits of the last `n_out` as [n_out, V].
        `kernels` (for all or for each token: ROW, PREFILL, TAIL) says which kernels compute it, in
        batches the model's `batching` allows for them."""
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
        rows = []
        for start, end in self.batching.batches(kinds):
            outs = max(0, end - max(first_out, start))
            if outs > self.batching.row_batch:  # the last layer runs on the rows read: on the row kernels
                raise InternalError(f"{outs} rows of logits from one prefill batch (at most {self.batching.row_batch})")
            for ptr in self._decode(tokens[start:end], len(self.kv), outs):
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())  # the next decode reuses it
            self.kv.extend(tokens[start:end])
            self.kv_kernels.extend(kinds[start:end])
        return np.stack(rows) if rows else np.empty((0, self.n_vocab), dtype=np.float32)

    def _decode(self, tokens: list[int], pos0: int, n_out: int):
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
        rc = lib.llama_decode(self._ctx, b)
        if rc != 0:
            # the cache may hold part of the batch now: forget it, so the next feed starts from what is known
            lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)
            raise RuntimeError(f"llama_decode failed ({rc}) on {n} tokens at position {pos0}{_last_errors()}")
        rows = []
        for i in range(n - n_out, n):
            ptr = lib.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no logits for batch row {i}{_last_errors()}")
            rows.append(ptr)
        return rows


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n, limit = 0, min(len(a), len(b), limit)
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _trailing_prefill(kernels: list[int]) -> int:
    """How many positions at the end of `kernels` the prefill kernels computed in whole gemm groups (a run that more
    positions may join: none after a TAIL, which ends its batch)."""
    n = 0
    while n < len(kernels) and kernels[-1 - n] == PREFILL:
        n += 1
    return n


@dataclass(frozen=True)
class Batching:
    """The llama_decode calls that give a position the same bits in any of them, for one weight layout: at most
    `row_batch` rows on the row kernels; on the prefill kernels at least PREFILL_MIN_ROWS, in multiples of
    `multiple` (module docstring)."""

    row_batch: int
    multiple: int

    @staticmethod
    def for_weights(repacked: bool) -> Batching:
        # repacked: gemv below GEMM_ROWS rows, whole gemm groups above; plain: vec_dot below the tiled matmul's floor
        return Batching(GEMM_ROWS - 1, GEMM_ROWS) if repacked else Batching(PREFILL_MIN_ROWS - 1, 1)

    def prefill_run(self, n: int) -> int:
        """The most of n positions one run on the prefill kernels can take (0: too few for a prefill batch)."""
        n -= n % self.multiple
        return n if n >= PREFILL_MIN_ROWS else 0

    def whole_runs(self, kernels: list[int]) -> list[int]:
        """`kernels` cut back to the last position a prefill batch can compute again (a trailing prefill run that a
        shared prefix or a rollback cut short is computed afresh). TAIL rows, however many of them are left, follow
        whole gemm groups of at least PREFILL_MIN_ROWS: a batch of those and them gives their bits again."""
        if kernels and kernels[-1] == TAIL:
            return kernels
        run = _trailing_prefill(kernels)
        return kernels[: len(kernels) - run + self.prefill_run(run)]

    def prompt_kernels(self, n: int) -> list[int]:
        """The kernels of a prompt of n ids, whatever came before it: one prefill run, its last token included, as
        llama.cpp's own generate reads a prompt (whole gemm groups, then the TAIL rows left); on the row kernels if
        too short for a prefill batch."""
        gemm = self.prefill_run(n)
        return [PREFILL] * gemm + [TAIL] * (n - gemm) if gemm else [ROW] * n

    def batches(self, kinds: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each llama_decode call: a run on the row kernels in batches of at most `row_batch`; a
        prefill run (PREFILL rows, then any TAIL rows) as `prefill_sizes` cuts it."""
        out, start = [], 0
        for family, counts in _family_runs(kinds):
            if family == ROW:
                sizes = _near_equal(counts[ROW], -(-counts[ROW] // self.row_batch))
            else:
                sizes = self.prefill_sizes(counts[PREFILL], counts[TAIL])
            for size in sizes:
                out.append((start, start + size))
                start += size
        return out

    def prefill_sizes(self, gemm: int, tail: int) -> list[int]:
        """The llama_decode calls of a prefill run of `gemm` PREFILL rows and then `tail` TAIL rows: as few as
        N_BATCH allows (llama_batch_init's arrays hold N_BATCH tokens: a longer call writes past them), near-equal,
        each but the last in whole gemm groups, the last taking the TAIL rows. Every call has at least
        PREFILL_MIN_ROWS rows (the prefill kernels' floor), as a run of at least that many split into parts of about
        N_BATCH / 2 or more does."""
        if not gemm or self.prefill_run(gemm) != gemm or tail >= self.multiple:
            raise InternalError(
                f"a prefill run of {gemm} + {tail} positions (prefill batches take {PREFILL_MIN_ROWS} or more, in "
                f"whole groups of {self.multiple} but for fewer TAIL rows)"
            )
        parts = -(-(gemm + tail) // N_BATCH)
        # the larger parts first: the last, which takes the TAIL rows, is one of the smaller, and so still fits
        sizes = [self.multiple * units for units in _near_equal(gemm // self.multiple, parts)]
        sizes[-1] += tail
        return sizes


def _near_equal(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one, the larger first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _family_runs(kinds: list[int]) -> list[tuple[int, dict[int, int]]]:
    """`kinds` as the runs llama_decode calls compute, in order: (ROW, {ROW: n}) for a run of row kinds, and
    (PREFILL, {PREFILL: g, TAIL: t}) for PREFILL rows and the TAIL rows that close them."""
    runs: list[tuple[int, dict[int, int]]] = []
    for kind, group in itertools.groupby(kinds):
        call = ROW if kind == ROW else PREFILL
        last = runs[-1] if runs else None
        joins = last is not None and last[0] == call and (call == ROW or (kind == TAIL and not last[1][TAIL]))
        if not joins:
            runs.append((call, {ROW: 0} if call == ROW else {PREFILL: 0, TAIL: 0}))
        runs[-1][1][ROW if call == ROW else kind] += len(list(group))
    return runs


def _free(lib, model, handles: list) -> None:
    for ctx, batch in handles:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    lib.llama_model_free(model)


class LlamaCppContext:
    """A model's token ids and its share of the model's llama.cpp cache: the decoding-context interface."""

    def __init__(self, model: LlamaCppModel, ids: list[int]):
        self.model = model
        self.ids = list(ids)
        self.kernels = model.batching.prompt_kernels(len(self.ids))
        """What computes each of the first len(kernels) ids (ROW, PREFILL, TAIL): the prompt's as the prompt alone
        decides, whatever the cache or an earlier turn held; ids added later get theirs at their first forward
        (`_decide_new`). Fixed when first decided, so that every evaluation of a position gives the same bits (module
        docstring)."""
        self.cache: LlamaCache | None = None
        """The cache this context last used."""
        self.cached = 0
        """How many of `ids` that cache holds (while this context owns it)."""
        self.matched = (0, 0)
        """(tokens, bytes) of the generated ids known to spell a prefix of the committed text (drafter sync)."""
        self.forward_s = 0.0
        """Seconds spent inside model forwards."""
        self.last = LastLogits()

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        self.last.drop_from(n)
        self.kernels = self.model.batching.whole_runs(self.kernels[:n])
        self.cached = min(self.cached, len(self.kernels))
        with self.model.lock:  # the cache drops the rest now if it is ours and free, else at our next forward
            if self.cache is not None and self.cache.owner is self and not self.cache.busy:
                self.cache.keep_first(self.cached)

    def _claim(self, cache: LlamaCache) -> None:
        """Own `cache`, keeping what it holds of our ids computed by our kernels."""
        if cache is self.cache and cache.owner is self:
            return
        n = _common_prefix(self.ids, cache.kv, limit=len(self.kernels))
        same = (a == b for a, b in zip(cache.kv_kernels[:n], self.kernels[:n], strict=True))
        self.cached = next((i for i, ok in enumerate(same) if not ok), n)
        self.cache, cache.owner = cache, self

    def _first_to_feed(self, start: int) -> int:
        """`start`, or earlier when it cuts into a prefill run: that run is fed again from where a prefill batch that
        ends with its gemm groups (and takes the TAIL rows after them) starts (`Batching.whole_runs`)."""
        if start >= len(self.ids) or self.kernels[start] == ROW:
            return start
        while self.kernels[start] == TAIL and self.kernels[start - 1] == TAIL:
            start -= 1  # the TAIL rows are those a batch leaves after its gemm groups: all of them or none
        end = start
        while end < len(self.ids) and self.kernels[end] == PREFILL:
            end += 1
        step = self.model.batching.multiple
        return end - max(PREFILL_MIN_ROWS, -(-(end - start) // step) * step)

    def _decide_new(self, n_out: int) -> None:
        """Kernels for the ids added since the prompt: those read without logits (a drafter catching up on the answer;
        the target never has such) on the prefill kernels as far as prefill batches reach, the rest on the row kernels
        (a verify, the target's steps, a drafter's steps)."""
        undecided = len(self.ids) - len(self.kernels)
        if undecided <= 0:
            return
        unread = max(0, len(self.ids) - n_out - len(self.kernels))
        run = _trailing_prefill(self.kernels)
        more = max(0, self.model.batching.prefill_run(run + unread) - run)
        self.kernels += [PREFILL] * more + [ROW] * (undecided - more)

    @torch.inference_mode()
    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` of them (0: all) as [n, V] float32.
        The first of them may be the last position fed, kept (`pair.LastLogits`): a prompt's last position, which
        only its whole prompt batch computes again."""
        t0 = time.perf_counter()
        with self.model.borrow(self) as cache:  # llama.cpp contexts are not thread-safe: one user each at a time
            self._claim(cache)
            n_out = max(keep or len(self.ids) - self.cached, 1)
            held = self.last.first_of(len(self.ids), n_out)
            if held is not None:
                n_out -= 1
                if not n_out:
                    return held[None]
            self._decide_new(n_out)
            # Logits are only had by feeding: when the cache already holds positions asked for (the last one, again;
            # or positions another context fed, sharing the model), they are fed again (same kernels, same bits).
            self.cached = self._first_to_feed(min(self.cached, len(self.ids) - n_out))
            cache.keep_first(self.cached)
            logits = cache.feed(self.ids[self.cached :], n_out, self.kernels[self.cached : len(self.ids)])
            self.cached = len(self.ids)
        self.forward_s += time.perf_counter() - t0
        out = torch.from_numpy(logits)
        self.last.keep(out, len(self.ids))
        return torch.cat([held[None], out]) if held is not None else out


def llama_with_our_attention(model: LlamaCppModel):
    """llama-cpp-python's own high-level `Llama` on `model`'s GGUF: llama.cpp's default kernels, with the attention
    settings our runner needs (flash attention, f16 K and bf16 V cache), so that it must compute our bits (the
    reference tests/test_llamacpp.py and scripts/check_llamacpp_reference.py compare against)."""
    _lib()
    from llama_cpp import Llama

    return Llama(
        model_path=str(model.path),
        n_ctx=model.n_ctx,
        n_threads=model.n_threads,
        flash_attn=True,
        type_k=GGML_TYPE_F16,
        type_v=GGML_TYPE_BF16,
        verbose=False,
    )


def batch_invariance(model: LlamaCppModel, ids: list[int], k: int = 8) -> float:
    """The largest logit difference that batching makes (0.0: none, as lossless decoding needs), over both: the last
    k+1 positions of `ids` evaluated one at a time against in row batches; and a prefill in one batch against in
    two. Leaves the model's cache empty."""
    if len(ids) < k + 2:  # the k + 1 positions checked follow at least one
        raise ValueError(f"checking a verify of {k + 1} positions needs at least {k + 2} ids, got {len(ids)}")
    with model.lock:
        return max(_row_gap(model, ids, k), _prefill_gap(model, ids))


def _row_gap(model: LlamaCppModel, ids: list[int], k: int) -> float:
    model.forget()
    head, tail = ids[: -k - 1], ids[-k - 1 :]
    model.feed(head, 0, model.batching.prompt_kernels(len(head)))
    single = np.concatenate([model.feed([t], 1) for t in tail])
    model.keep_first(len(head))
    batched = model.feed(tail, k + 1)
    model.forget()
    return float(np.abs(single - batched).max())


def _prefill_gap(model: LlamaCppModel, ids: list[int]) -> float:
    """The next position's logits after a prefill in one batch and in two (0.0 if too short to split)."""
    head = ids[: model.batching.prefill_run(len(ids) - 1)]
    cut = model.batching.prefill_run(len(head) // 2)
    if not cut or model.batching.prefill_run(len(head) - cut) != len(head) - cut:
        return 0.0
    nxt = ids[len(head) : len(head) + 1]
    model.forget()
    model.feed(head, 0, PREFILL)
    whole = model.feed(nxt, 1)
    model.forget()
    model.feed(head[:cut], 0, PREFILL)
    model.feed(head[cut:], 0, PREFILL)
    split = model.feed(nxt, 1)
    model.forget()
    return float(np.abs(whole - split).max())
