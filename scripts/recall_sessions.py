"""The `recall` set's summary: wall time of requests 2-3 of each session (usd/datasets.py, `recall_prompts`: each a
new conversation asking for an earlier answer again with a change), per algorithm, and whether every answer is plain
decoding's.

    usd bench --dataset recall --algorithms none,ngram,suffix --max-new-tokens 160 --json docs/bench/recall.json
    python scripts/recall_sessions.py docs/bench/recall.json

`usd bench` runs the prompts in order and gives each algorithm a memory of its own (as a fresh `usd serve` per
algorithm would hold), so the summary reads the requests an earlier answer can serve.
"""

from __future__ import annotations

import json
import sys


def summary(path: str) -> None:
    """Wall time of requests 2-3 per algorithm, their ratios, and whether every answer equals plain decoding's."""
    with open(path) as f:
        result = json.load(f)
    runs = [r for r in result["prompts"] if not r["prompt"].endswith("-1")]
    wall: dict[str, float] = {}
    plain = {r["prompt"]: r["target_ids"] for r in runs if r["algorithm"] == "none"}
    identical = all(r["target_ids"] == plain[r["prompt"]] for r in runs)
    for r in runs:
        wall[r["algorithm"]] = wall.get(r["algorithm"], 0.0) + r["wall_s"]
    for a, s in wall.items():
        print(f"{a:8s} requests 2-3: {s:7.2f} s   {wall['none'] / s:.2f}x plain")
    if "suffix" in wall and "ngram" in wall:
        print(f"suffix / ngram wall time: {wall['suffix'] / wall['ngram']:.2f}")
    print(f"every answer identical to plain decoding's: {identical}")


if __name__ == "__main__":
    summary(sys.argv[1])
