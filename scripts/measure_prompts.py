"""How fast a model reads a prompt on this machine: on its own weights' prefill kernels and, where the CPU has AMX, on
its twin's AMX tiles (usd/runners/llamacpp/twin.py, the sequence copied in and out included), alternating in one
process, medians. Prints tokens a second for each prompt length and the twin's speedup.

    PYTHONPATH=. python scripts/measure_prompts.py [MODEL ...] [--lengths 64 256 512] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

from usd.catalog import load_catalog
from usd.runners import llamacpp
from usd.store import gguf_file


def prompt_seconds(model: llamacpp.LlamaCppModel, ids: list[int], twin) -> float:
    """Seconds to read `ids` as a prompt, its last position's logits included, with `twin` (or None) reading it."""
    for cache in model.pool.caches:
        cache.twin = twin
    model.forget()
    t0 = time.perf_counter()
    model.feed(ids, 1, model.batching.kernels([], len(ids), 1))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    catalog = load_catalog()
    print("| model | prompt tokens | own weights, tok/s | twin on AMX tiles, tok/s | twin / own |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models:
        model = llamacpp.LlamaCppModel(gguf_file(catalog.get(name), log=lambda m: None))
        twin = model.twin
        if twin is None:
            raise SystemExit(f"{name} has no twin here: {llamacpp.binding.amx_prefill_why()}")
        ids = [(7 * i + 1000) % model.n_vocab for i in range(max(args.lengths))]
        for n in args.lengths:
            own, tiles = [], []
            for _ in range(args.repeats):
                own.append(prompt_seconds(model, ids[:n], None))
                tiles.append(prompt_seconds(model, ids[:n], twin))
            a, b = statistics.median(own), statistics.median(tiles)
            print(f"| {name} | {n} | {n / a:.1f} | {n / b:.1f} | {a / b:.2f}x |")
        model.close()


if __name__ == "__main__":
    main()
