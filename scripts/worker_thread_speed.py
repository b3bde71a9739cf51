"""Plain decoding on the thread that loaded the pair against the same decoding on a worker thread (as the app and the
server decode), in one process, alternating: tokens/s and the median llama_decode call of each.

    PYTHONPATH=. python scripts/worker_thread_speed.py --repeats 3 --tokens 96

Run it once per llama.cpp build to compare builds (docs/benchmarks.md, "llama.cpp on its own threads"); the load line
on stderr says which build runs. Nothing is downloaded: the models must be pulled (`usd pull`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

PROMPT = "Write a Python module that implements a singly linked list class with methods to append and prepend."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--target")
    args = ap.parse_args()
    from usd.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    import usd
    from usd.chat import user_turn
    from usd.runners.llamacpp import cache

    pair = usd.load_pair(args.target, False, log=lambda line: print(line, file=sys.stderr))
    calls: list[float] = []
    decode = cache.LlamaCache._decode

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return decode(self, *a, **kw)
        finally:
            calls.append(time.perf_counter() - t0)

    cache.LlamaCache._decode = timed

    def generate(out: list) -> None:
        calls.clear()
        t0 = time.perf_counter()
        for event in usd.stream(pair, messages=user_turn(PROMPT), algorithm="none", max_new_tokens=args.tokens):
            if isinstance(event, usd.Finished):
                out.append((event.stats.tokens / (time.perf_counter() - t0), statistics.median(calls)))

    results: dict[str, list] = {"loading thread": [], "worker thread": []}
    for _ in range(args.repeats):
        generate(results["loading thread"])
        worker = threading.Thread(target=generate, args=(results["worker thread"],))
        worker.start()
        worker.join()
    for where, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        step = statistics.median(s for _, s in runs)
        print(f"{where}: {rate:.1f} tok/s, median llama_decode {step * 1e3:.1f} ms ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
