"""What the llama.cpp runner's batch-invariant kernel settings cost: prefill and decode speed of the target under each
setting, and each setting's batch gap (the largest logit difference between single steps and a row batch of 2, 5 and
9, and between a prefill in one batch and in two; lossless needs 0). Run it with GGML_CPU_TILED_MM=0 to see the
prefill without the tiled matmul.

    PYTHONPATH=. python scripts/measure_llamacpp_kernels.py [MODEL]

Same process, interleaved rounds, medians.
"""

from __future__ import annotations

import statistics
import sys
import time

from usd.catalog import load_catalog
from usd.loading import load_tokenizer
from usd.runners import llamacpp
from usd.runners.llamacpp.binding import GGML_TYPE_F16, library
from usd.store import gguf_file, local_path

FUNC = 'def add_{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
PROMPT = "".join(FUNC.format(i=i) for i in range(14))
STEPS, ROUNDS = 24, 3


def timings(model: llamacpp.LlamaCppModel, ids: list[int]) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) from an empty cache."""
    model.forget()
    t0 = time.perf_counter()
    model.feed(ids, 1, model.batching.kernels([], len(ids), 1))  # as the runner reads a prompt
    prefill = time.perf_counter() - t0
    token = ids[-1]
    t0 = time.perf_counter()
    for _ in range(STEPS):
        token = int(model.feed([token], 1)[-1].argmax())
    return prefill, STEPS / (time.perf_counter() - t0)


def main(name: str) -> None:
    lib = library()
    entry = load_catalog().get(name)
    path = gguf_file(entry, log=lambda m: None)
    ids = load_tokenizer(entry, local_path(entry)).encode(PROMPT)
    f16, no_fa = GGML_TYPE_F16, lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    settings = {
        "the runner's (flash attention, f16 K, bf16 V, repacked weights)": {},
        "plain weights": {"repacked_weights": False},
        "f16 V": {"type_v": f16},
        "no flash attention, f16 V": {"flash_attn_type": no_fa, "type_v": f16},
    }
    models = {label: llamacpp.LlamaCppModel(path, n_ctx=2048, **kw) for label, kw in settings.items()}
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in models}
    for _ in range(ROUNDS):
        for label, model in models.items():
            runs[label].append(timings(model, ids))
    print(f"{name}, {len(ids)}-token prompt, medians of {ROUNDS} interleaved rounds\n")
    print("| setting | prefill ms | decode tok/s | batch gap |\n|---|---|---|---|")
    for label, model in models.items():
        gap = max(llamacpp.batch_invariance(model, ids[:200], k) for k in (1, 4, 8))
        prefill = statistics.median(r[0] for r in runs[label])
        rate = statistics.median(r[1] for r in runs[label])
        print(f"| {label} | {prefill * 1e3:.0f} | {rate:.1f} | {gap:.3g} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct")
