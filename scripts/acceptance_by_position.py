"""Does acceptance depend on the draft position, and does a cost model that knows it predict a round's tokens better
than auto's one pooled alpha? Records every round of greedy generations at fixed k = 1..8 and compares, for each k,
the tokens a round emitted with what each model, fitted on some of the rounds, expects:

- pooled (what `schedule.CostModel` uses): tau(alpha, k), alpha over every tested position;
- first/then: 1 + a tau(b, k - 1), a the first candidate's acceptance and b each later one's once all before it were.

    PYTHONPATH=. python scripts/acceptance_by_position.py --precision gguf --limit 6 \\
        --json docs/bench/positions-gguf.json

Fits: on every k, on k <= 2 (where a schedule that started short would learn) and on k = K_START (auto's first tries).
Only acceptance matters here, so the runner's speed does not; greedy, so the rounds are the same on every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import usd
from usd.datasets import load_prompts
from usd.events import Round
from usd.schedule import K_MAX, K_START, tau, tested_positions


def record(pair, prompts, algorithm: str, max_new_tokens: int) -> list[dict]:
    rounds = []
    for k in range(1, K_MAX + 1):
        for prompt in prompts:
            events = usd.stream(
                pair,
                prompt.prompt,
                messages=list(prompt.messages) if prompt.messages else None,
                algorithm=algorithm,
                draft_tokens=k,
                max_new_tokens=max_new_tokens,
            )
            rounds += [
                {"k": k, "drafted": e.drafted, "accepted": e.accepted}
                for e in events
                if isinstance(e, Round) and e.algorithm == algorithm
            ]
    return rounds


def by_position(rounds: list[dict]) -> list[tuple[int, int]]:
    """(accepted, tested) at each draft position."""
    counts: list[list[int]] = []
    for r in rounds:
        for i in range(tested_positions(r["accepted"], r["drafted"])):
            if i == len(counts):
                counts.append([0, 0])
            counts[i][0] += i < r["accepted"]
            counts[i][1] += 1
    return [(a, t) for a, t in counts]


def fit(rounds: list[dict]) -> dict:
    counts = by_position(rounds)
    hits, tests = sum(a for a, _ in counts), sum(t for _, t in counts)
    later_hits, later_tests = hits - counts[0][0], tests - counts[0][1]
    return {
        "pooled": hits / tests,
        "first": counts[0][0] / counts[0][1],
        "then": later_hits / later_tests if later_tests else hits / tests,
    }


def compare(rounds: list[dict]) -> dict:
    emitted = {k: [r["accepted"] + 1 for r in rounds if r["k"] == k] for k in range(1, K_MAX + 1)}
    measured = {k: sum(v) / len(v) for k, v in emitted.items() if v}
    fits = {"every k": lambda k: True, "k <= 2": lambda k: k <= 2, f"k = {K_START}": lambda k: k == K_START}
    out = {"measured": measured, "by_position": by_position(rounds), "fits": {}}
    for name, chosen in fits.items():
        f = fit([r for r in rounds if chosen(r["k"])])
        pooled = {k: tau(f["pooled"], k) for k in measured}
        first_then = {k: 1 + f["first"] * tau(f["then"], k - 1) for k in measured}
        out["fits"][name] = {
            **f,
            "pooled_error": sum(abs(pooled[k] - measured[k]) for k in measured) / len(measured),
            "first_then_error": sum(abs(first_then[k] - measured[k]) for k in measured) / len(measured),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="smollm2-135m-instruct")
    ap.add_argument("--precision", default="gguf")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--algorithms", default="tli,slem")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    pair = usd.load_pair(args.target, args.drafter, precision=args.precision, log=lambda *a: None)
    prompts = load_prompts(args.dataset, args.limit)
    report = {}
    for algorithm in args.algorithms.split(","):
        result = report[algorithm] = compare(record(pair, prompts, algorithm, args.max_new_tokens))
        rates = ", ".join(f"{a}/{t}" for a, t in result["by_position"])
        print(f"{algorithm}: accepted/tested by position {rates}")
        print("  measured tokens a round, k = 1..8: " + ", ".join(f"{v:.2f}" for v in result["measured"].values()))
        for name, f in result["fits"].items():
            print(
                f"  fit on {name}: pooled {f['pooled']:.2f}, first {f['first']:.2f}, then {f['then']:.2f}; mean error "
                f"of tokens a round: pooled {f['pooled_error']:.3f}, first/then {f['first_then_error']:.3f}"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
