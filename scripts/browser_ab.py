"""Two versions of the app side by side in one run: the Chat tab's tokens/s in a real browser, answers alternating
between the versions, and `usd generate` on the same prompt after each pair as the reference. On a shared, noisy
machine a difference of a few percent only shows this way, not between two runs of scripts/browser_vs_engine.py.

    git worktree add /tmp/before <commit>
    PYTHONPATH=. python scripts/browser_ab.py --a /tmp/before --b . --repeats 3 --json docs/bench/ab.json

Each version runs as a user starts it (`python -m app` in its own checkout, the default pair); both stay loaded, only
one answers at a time. Each version's first answer (auto after a load) is left out. Per repeat: for each algorithm,
one answer from each version (which goes first alternates) and one `usd generate`. Prints the medians and their
ratios to `usd generate`.

Its positions are not equal: with the same commit as both versions, B ran 8-10% faster than A in every pair of
answers (docs/benchmarks.md, docs/bench/ab-same-code.json), cause not found. Run a same-code check first, and a
change in both orders (--a old --b new, then --a new --b old) before reading a difference."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import browser_vs_engine as bench

VERSIONS = ("A", "B")
ALGORITHMS = ("none", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="version A's checkout")
    parser.add_argument("--b", required=True, help="version B's checkout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pair = argparse.Namespace(app_threads=None, target=None, drafter=None)

    from playwright.sync_api import sync_playwright

    apps, urls = {}, {}
    for name, root in zip(VERSIONS, (args.a, args.b), strict=True):
        port = bench.free_port()
        apps[name] = bench.start_app(port, pair, Path(f"/tmp/browser-ab-{name}.log"), Path(root).resolve())
        urls[name] = f"http://127.0.0.1:{port}/"
    speeds: dict[str, dict[str, list[float]]] = {name: {} for name in (*VERSIONS, "engine")}
    try:
        with sync_playwright() as playwright:
            pages = {name: bench.Page(playwright, urls[name], args.tokens) for name in VERSIONS}
            for name in VERSIONS:
                pages[name].chat("auto", bench.PROMPT)  # the first answer after a load, left out
            for r in range(args.repeats):
                for algorithm in ALGORITHMS if r % 2 == 0 else ALGORITHMS[::-1]:
                    for name in VERSIONS if r % 2 == 0 else VERSIONS[::-1]:
                        time.sleep(2)
                        tps = pages[name].chat(algorithm, bench.PROMPT)["tokens_per_s"]
                        speeds[name].setdefault(algorithm, []).append(tps)
                        print(f"repeat {r} {algorithm} {name}: {tps:.2f} tok/s", flush=True)
                    engine = bench.engine(algorithm, bench.PROMPT, args.tokens, pair)["first_to_last_tokens_per_s"]
                    speeds["engine"].setdefault(algorithm, []).append(engine)
                    print(f"repeat {r} {algorithm} usd generate: {engine:.2f} tok/s", flush=True)
    finally:
        for proc in apps.values():
            proc.terminate()
    for algorithm in ALGORITHMS:
        engine = statistics.median(speeds["engine"][algorithm])
        medians = {n: statistics.median(speeds[n][algorithm]) for n in VERSIONS}
        cells = "; ".join(f"{n} {m:.2f} tok/s ({m / engine:.2f}x)" for n, m in medians.items())
        print(f"{algorithm}: usd generate {engine:.2f} tok/s; {cells}")
    if args.json:
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "tokens/s": speeds}, indent=1))


if __name__ == "__main__":
    main()
