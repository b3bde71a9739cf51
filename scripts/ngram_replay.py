"""What the n-gram lookup would gain on known greedy answers, for several match lengths and draft lengths: the plain
answers of a `usd bench --json` run are replayed (a greedy answer is fixed, so each round's acceptance is known), and
each round is priced by the verify costs v(k) measured at load (`pair-costs.json` through usd.costs) or given.

    PYTHONPATH=. python scripts/ngram_replay.py BENCH.json --dataset edits

It prints, per (n_min..n_max, k), the tokens per target step (the speedup over plain decoding, prefill left out) and
per match length n how many rounds drafted and what share of their candidates the target kept. Only the target's
tokenizer is loaded (no model), so it runs in seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from usd.catalog import load_catalog
from usd.datasets import load_prompts
from usd.loading import load_tokenizer
from usd.ngram import NgramIndex
from usd.schedule import interpolate
from usd.store import local_path


def prompt_ids(tokenizer, prompt) -> list[int]:
    if prompt.messages:
        return tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, return_dict=False)
    return tokenizer.encode(prompt.prompt)


def replay(answers, v: dict[int, float], k: int, n_min: int, n_max: int) -> tuple[float, dict]:
    """(tokens per target step, {n: [rounds, candidates, kept]}) with a draft of up to k looked-up tokens a round."""
    tokens = steps = 0.0
    by_n: dict[int, list[int]] = {}
    for prompt, answer in answers:
        index = NgramIndex(list(prompt), n_min, n_max)
        i = 0
        while i < len(answer):
            found = index.lookup(k)
            candidates = found.candidates if found else []
            kept = 0
            while kept < len(candidates) and i + kept < len(answer) and candidates[kept] == answer[i + kept]:
                kept += 1
            if found:
                cell = by_n.setdefault(found.n, [0, 0, 0])
                cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + len(candidates), cell[2] + kept
            emitted = min(kept + 1, len(answer) - i)
            steps += interpolate(v, len(candidates) + 1)
            tokens += emitted
            index.extend(answer[i : i + emitted])
            i += emitted
    return tokens / steps, by_n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="a `usd bench --json` result with a `none` row")
    ap.add_argument("--dataset", required=True, help="the dataset the bench ran (its prompts are rebuilt)")
    ap.add_argument("--v", default="1:1.60,2:2.15,4:3.86", help="k:v(k),...: a verify's cost over a plain step")
    args = ap.parse_args()
    result = json.loads(Path(args.bench).read_text())
    catalog = load_catalog()
    entry = catalog.get(result["machine"].get("target") or catalog.default.target)
    tokenizer = load_tokenizer(entry, local_path(entry))
    prompts = {p.id: p for p in load_prompts(args.dataset)}
    answers = [(prompt_ids(tokenizer, prompts[r["prompt"]]), r["target_ids"]) for r in result["prompts"] if r["k"] == 0]
    given = {int(k): float(x) for k, x in (pair.split(":") for pair in args.v.split(","))}
    v = {1: 1.0} | {k + 1: x for k, x in given.items()}  # positions fed -> cost in plain steps
    print(f"{len(answers)} greedy answers; v(k): {given}")
    print("| match lengths | k | tokens per step | per match length n: rounds, kept share |\n|---|---:|---:|---|")
    for n_min, n_max in ((2, 4), (3, 8)):
        for k in (1, 2, 3, 4):
            rate, by_n = replay(answers, v, k, n_min, n_max)
            cells = "; ".join(f"n={n}: {r}, {kept / c:.2f}" for n, (r, c, kept) in sorted(by_n.items()))
            print(f"| {n_min}..{n_max} | {k} | {rate:.3f} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
