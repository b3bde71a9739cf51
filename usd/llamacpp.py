"""The llama.cpp runner: a model's GGUF file run as it is (its own quantized weights) through llama-cpp-python's
low-level API, behind the decoding-context interface the decode loop drives (`pair.Context`): `ids`, `forward(keep)`,
`truncate(n)`, `forward_s`, `matched`, `cached`.

Lossless needs a position's logits to be the same bits whether the position is fed alone (plain decoding, a drafter
step) or inside a batch (the target's verify, a prefill, a resync). llama.cpp's CPU backend picks kernels by batch
size, and some sum in another order than the one-row kernels. Measured (llama-cpp-python 0.3.36, AVX-512, the
registry's Qwen 0.5B and SmolLM2 GGUFs; `batch_invariance`), before the settings below: 0.3-1.1 logits apart.

- Attention was the cause. Without flash attention, KQ and KQV are matmuls against the f16 cache, which llamafile's
  tinyBLAS serves for two queries or more and vec_dot for one. With flash attention and an f16 cache, one query over
  512 cached positions or more takes a split-KV kernel and 64 queries or more a tiled one. So: flash attention on, with
  a bf16 V cache beside the f16 K cache, which keeps every batch on the one-row kernel (it skips masked positions, so
  the cache's padding does not matter either). Both differences vanish: 0.0 at every length and batch tried.
- Repacked weights (the "extra buffer types", interleaved Q4_0/Q4_K/IQ4_NL... for AVX2/AVX-512) multiply 4 rows at a
  time with a gemm kernel and the rest with a gemv kernel: not loaded (`use_extra_bufts = False`).
- The tiled K-quant matmul (8 rows or more) sums blocks in another order than vec_dot: off (GGML_CPU_TILED_MM=0, set
  before llama.cpp first reads it).
- tinyBLAS also serves the Q8_0/Q5_0 weights of these GGUFs at two rows or more; on this CPU it gives vec_dot's bits.
  Should another CPU differ, tests/test_llamacpp.py says so, and -DGGML_LLAMAFILE=OFF in CMAKE_ARGS is the fix.

One llama.cpp context per model is reused by every generation: `new_context(ids)` keeps the longest common prefix of
what the cache holds (a multi-turn chat re-feeds only the new turn) and drops the rest.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

N_CTX_CAP = 8192
"""The most positions a llama.cpp context gets (the catalog's context length, capped for memory)."""
N_BATCH = 512
"""Tokens per llama_decode call: prefills go in chunks of this; every verify (at most 17 tokens) fits in one."""
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
        os.environ["GGML_CPU_TILED_MM"] = "0"  # read once, at llama.cpp's first matmul: see the module's docstring
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
    """A GGUF loaded by llama.cpp, with one llama.cpp context (KV cache) that its decoding contexts take turns on."""

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
        repacked_weights: bool = False,
        **context_params,
    ):
        lib = _lib()
        self.path = Path(path)
        self.name_or_path = name or self.path.stem
        self.generation_config = generation_config
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        # no repacked weights: their gemm and gemv kernels sum differently (True only for measurements)
        mp.use_extra_bufts = repacked_weights
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
        ctx = lib.llama_init_from_model(model, cp)
        if not ctx:
            lib.llama_model_free(model)
            raise RuntimeError(f"llama.cpp could not create a context for {self.path}{_last_errors()}")
        batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self._lib, self._model, self._ctx, self._batch = lib, model, ctx, batch
        self._mem = lib.llama_get_memory(ctx)
        self._finalizer = weakref.finalize(self, _free, lib, model, ctx, batch)
        self.n_ctx = lib.llama_n_ctx(ctx)
        self.n_threads = threads
        self.config = GGUFConfig(max_position_embeddings=self.n_ctx, vocab_size=self.n_vocab, n_ctx_train=n_train)
        self.kv: list[int] = []
        """The ids whose keys and values the cache holds, at positions 0..len-1."""
        self.owner: LlamaCppContext | None = None
        """The decoding context whose ids the cache follows; another one first keeps only what they share."""
        self.lock = threading.RLock()
        """Held for every use of the llama.cpp context, which is not thread-safe: generations running at once (the
        server's slots, the app's concurrency) take turns on it, each re-feeding what the other displaced."""

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.path.name}, n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, threads={self.n_threads})"

    def new_context(self, ids: list[int]) -> LlamaCppContext:
        return LlamaCppContext(self, ids)

    def close(self) -> None:
        self._finalizer()

    # --- the cache -------------------------------------------------------------------------------------------------

    def forget(self) -> None:
        """Empty the cache: the next context feeds everything."""
        with self.lock:
            self.owner = None
            self.keep_first(0)

    def keep_first(self, n: int) -> None:
        """Drop the cached positions from n on (sequence removal: the cache's own rollback)."""
        if len(self.kv) > n:
            if not self._lib.llama_memory_seq_rm(self._mem, 0, n, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {n}.. from its cache{_last_errors()}")
            del self.kv[n:]

    def feed(self, tokens: list[int], n_out: int) -> np.ndarray:
        """Evaluate `tokens` at the positions after the cache; return the logits of the last `n_out` as [n_out, V]."""
        if len(self.kv) + len(tokens) > self.n_ctx:
            raise ValueError(
                f"{self.name_or_path}: {len(self.kv) + len(tokens):,} positions do not fit the llama.cpp "
                f"context of {self.n_ctx:,}"
            )
        n_out = min(n_out, len(tokens))
        out = np.empty((n_out, self.n_vocab), dtype=np.float32)
        first_out = len(tokens) - n_out
        start, row = 0, 0
        while start < len(tokens):
            # a chunk: at most N_BATCH tokens, and at most N_OUTPUTS of them with logits
            end = min(len(tokens), start + N_BATCH)
            if end > first_out:
                end = min(end, max(first_out, start) + N_OUTPUTS)
            rows = self._decode(tokens[start:end], len(self.kv), max(0, end - max(first_out, start)))
            for ptr in rows:
                out[row] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))  # copied: the next decode reuses it
                row += 1
            self.kv.extend(tokens[start:end])
            start = end
        return out

    def _decode(self, tokens: list[int], pos0: int, n_out: int):
        lib, b = self._lib, self._batch
        n = len(tokens)
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


def _free(lib, model, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)


class LlamaCppContext:
    """A model's token ids and its share of the model's llama.cpp cache: the decoding-context interface."""

    def __init__(self, model: LlamaCppModel, ids: list[int]):
        self.model = model
        self.ids = list(ids)
        self.cached = 0
        """How many of `ids` the cache holds (while this context owns the cache)."""
        self.matched = (0, 0)
        """(tokens, bytes) of the generated ids known to spell a prefix of the committed text (drafter sync)."""
        self.forward_s = 0.0
        """Seconds spent inside model forwards."""

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        self.cached = min(self.cached, n)  # the cache drops the rest at the next forward

    def _claim(self) -> None:
        m = self.model
        if m.owner is self:
            return
        n, limit = 0, min(len(m.kv), len(self.ids))
        while n < limit and m.kv[n] == self.ids[n]:
            n += 1
        self.cached, m.owner = n, self

    @torch.inference_mode()
    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` of them (0: all) as [n, V] float32."""
        t0 = time.perf_counter()
        with self.model.lock:  # one llama.cpp context: generations on other threads wait for their turn on it
            self._claim()
            # Logits are only had by feeding: when the cache already holds positions asked for (the last one, again;
            # or positions another context fed, sharing the model), they are fed again (same bits: see the docstring).
            self.cached = min(self.cached, len(self.ids) - max(keep, 1))
            self.model.keep_first(self.cached)
            new = self.ids[self.cached :]
            logits = self.model.feed(new, keep or len(new))
            self.cached = len(self.ids)
        self.forward_s += time.perf_counter() - t0
        return torch.from_numpy(logits)


def batch_invariance(model: LlamaCppModel, ids: list[int], k: int = 8) -> float:
    """The largest difference between the logits of the last k+1 positions of `ids` evaluated one at a time and in
    one batch (0.0: the same bits, as lossless decoding needs). Leaves the model's cache empty."""
    k = min(k, len(ids) - 1)
    with model.lock:
        return _batch_gap(model, ids, k)


def _batch_gap(model: LlamaCppModel, ids: list[int], k: int) -> float:
    model.forget()
    model.feed(ids[: -k - 1], 1)
    single = np.concatenate([model.feed([t], 1) for t in ids[-k - 1 :]])
    model.keep_first(len(ids) - k - 1)
    batched = model.feed(ids[-k - 1 :], k + 1)
    model.keep_first(0)
    return float(np.abs(single - batched).max())
