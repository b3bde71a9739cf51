"""What a verify of n tokens costs on this machine, v(n) = V(n) / V(1) for n = 1..16, for each weight layout (repacked,
as the runner loads it, and plain) under each rule: the exact-rows patch (one llama_decode call of n rows) and the
unpatched one (calls of at most 3 rows with repacked weights, 7 with plain). Also each call's batch gap against single
steps (lossless needs 0), and the memory floor: the weight bytes a step reads over this machine's read bandwidth
(numpy summing a 1 GiB array on every core), against the plain step measured.

    PYTHONPATH=. python scripts/measure_verify_rows.py [MODEL] [--cached N] [--repeats R]

Same process, every length of a layout and rule interleaved in each repeat, medians. Needs the patched llama.cpp
(./dev.sh setup) for the exact-rows columns.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from usd.catalog import load_catalog
from usd.runners import cpu_threads, llamacpp
from usd.runners.llamacpp import binding
from usd.store import gguf_file

SIZES = range(1, llamacpp.EXACT_ROWS + 1)


def read_bandwidth(threads: int, gib: int = 1) -> float:
    """Bytes a second that `threads` threads read summing their share of a `gib` GiB array (the best of 5)."""
    data = np.ones(gib << 28, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(5):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def step_bytes(path) -> int:
    """The weight bytes a step reads: every matrix but the token embedding (a lookup of one row)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2 and not t.name.startswith("token_embd"))


def costs(model, repacked: bool, ids: list[int], cached: int, exact: bool, repeats: int):
    """({n: median seconds of a verify of n}, {n: its batch gap}) under one rule."""
    binding.set_exact_rows(llamacpp.EXACT_ROWS if exact else 0)
    batching = llamacpp.Batching.for_weights(repacked, llamacpp.EXACT_ROWS if exact else 0)
    cache = model.pool.caches[0]
    model.batching = cache.batching = batching
    gaps = llamacpp.row_gaps(model, ids[: cached + max(SIZES)], list(SIZES)[1:]) | {1: 0.0}
    model.feed(ids[:cached], 0, batching.kernels([], cached, 0))
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(repeats):
        for n in SIZES:
            cache.keep_first(cached)
            t0 = time.perf_counter()
            model.feed(ids[cached : cached + n], n)
            times[n].append(time.perf_counter() - t0)
    model.forget()
    return {n: statistics.median(t) for n, t in times.items()}, gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--cached", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    binding.library()
    if not binding.exact_rows():
        raise SystemExit(f"exact rows are off: {binding.exact_rows_why()}")
    path = gguf_file(load_catalog().get(args.model), log=lambda m: None)
    rng = np.random.default_rng(0)
    table = {}
    for repacked in (True, False):
        model = llamacpp.LlamaCppModel(path, repacked_weights=repacked)
        ids = [int(t) for t in rng.integers(1000, 30000, args.cached + max(SIZES))]
        for exact in (True, False):
            table[(repacked, exact)] = costs(model, repacked, ids, args.cached, exact, args.repeats)
        model.close()
    binding.set_exact_rows(llamacpp.EXACT_ROWS)
    threads = cpu_threads()
    bandwidth = read_bandwidth(threads)
    floor = step_bytes(path) / bandwidth
    step = table[(True, True)][0][1]
    print(f"{args.model}, {args.cached} cached positions, {threads} threads, medians of {args.repeats}\n")
    print("| layout, rule | " + " | ".join(f"v({n})" for n in SIZES) + " | largest gap |")
    print("|---|" + "---|" * (len(SIZES) + 1))
    for (repacked, exact), (times, gaps) in table.items():
        label = f"{'repacked' if repacked else 'plain'} weights, {'exact rows' if exact else 'unpatched rule'}"
        row = " | ".join(f"{times[n] / times[1]:.2f}" for n in SIZES)
        print(f"| {label} | {row} | {max(gaps.values()):.3g} |")
    print(
        f"\nmemory floor: {step_bytes(path) / 1e9:.2f} GB of weights a step at {bandwidth / 1e9:.1f} GB/s "
        f"({threads} threads) = {floor * 1e3:.1f} ms; the plain step {step * 1e3:.1f} ms, "
        f"{floor / step:.0%} of it at the floor"
    )


if __name__ == "__main__":
    main()
