"""Soak the suffix memory through the server: N chat requests (default 10,000) to an in-process `usd serve` on the
tests' tiny pair, algorithm suffix, each prompt different so that every answer is new to the memory, with the
memory's bound set low. Prints the process's RSS and the memory's counted bytes every REPORT requests: both stay flat
once the memory is full, and the counted bytes never pass the bound.

    PYTHONPATH=.:tests python scripts/suffix_soak.py --requests 10000 --bound 256KiB --json docs/bench/suffix-soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

REPORT = 500


def main() -> int:
    import httpx
    from tiny_serving import new_answer_request, rss_mb, served_pair, serving

    from usd import suffix
    from usd.serve import FixedPair, Slots, create_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--bound", default="256KiB")
    parser.add_argument("--json")
    args = parser.parse_args()
    bound = suffix.parse_size(args.bound)
    suffix.MEMORY.resize(bound)
    pair, _ = served_pair()
    rows, worst = [], 0
    t0 = time.perf_counter()
    with serving(create_app(FixedPair(pair, slots=Slots(1, 4)))) as root, httpx.Client(timeout=60) as client:
        for i in range(1, args.requests + 1):
            client.post(f"{root}/v1/chat/completions", json=new_answer_request(pair, i)).raise_for_status()
            worst = max(worst, suffix.MEMORY.nbytes)
            if i % REPORT == 0 or i == 1:
                row = {
                    "requests": i,
                    "rss_mb": round(rss_mb(), 1),
                    "memory_bytes": suffix.MEMORY.nbytes,
                    "answers_kept": len(suffix.MEMORY.order),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"bound {bound:,} bytes; the most the memory counted after any request: {worst:,} bytes")
    if args.json:
        Path(args.json).write_text(json.dumps({"bound": bound, "most": worst, "rows": rows}, indent=1) + "\n")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
