"""Checks of the llama.cpp runner against llama.cpp itself: how far batching moves a position's logits, and llama.cpp's
own generate with the attention settings the runner needs (the reference tests/test_llamacpp.py and
scripts/check_llamacpp_reference.py compare against)."""

from __future__ import annotations

import numpy as np

from .binding import GGML_TYPE_BF16, GGML_TYPE_F16, library
from .kernels import PREFILL
from .model import LlamaCppModel, row_gaps


def llama_with_our_attention(model: LlamaCppModel):
    """llama-cpp-python's own high-level `Llama` on `model`'s GGUF: llama.cpp's default kernels, with the attention
    settings our runner needs (flash attention, f16 K and bf16 V cache), so that it must compute our bits (the
    reference tests/test_llamacpp.py and scripts/check_llamacpp_reference.py compare against)."""
    library()
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
    with model.pool.lock:
        return max(row_gaps(model, ids, [k + 1])[k + 1], _prefill_gap(model, ids))


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
