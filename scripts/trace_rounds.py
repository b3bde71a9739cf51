"""What auto (or any algorithm) did round by round on a bench set, side by side with other algorithms: per answer
its wall time, its rounds by mode, and in the rounds where the n-gram lookup did not run, why it was off (the
sources' states the panel shows). Each answer is one generation of the loaded pair, in the bench's order (the
algorithms alternating from prompt to prompt, each remembering its own earlier answers), after a warm-up.

    PYTHONPATH=. python scripts/trace_rounds.py --dataset edits --limit 12 --algorithms ngram,auto --json rounds.json

The JSON holds every round: its algorithm, k, drafted and accepted counts, draft, verify and other seconds, and each
source's state and speedup.
"""

from __future__ import annotations

import argparse
import collections
import json

import usd
from usd import decoder
from usd.algorithms import Algorithm
from usd.bench.run import _ids, forget_caches
from usd.datasets import load_prompts
from usd.events import Finished, Round
from usd.settings import GenerationSettings
from usd.suffix import SuffixMemory


def answer(pair, prompt, algorithm: Algorithm, max_new_tokens: int, scope=None) -> tuple[float, list[dict]]:
    forget_caches(pair)
    how = GenerationSettings(algorithm=algorithm, draft_tokens="auto", max_new_tokens=max_new_tokens)
    wall, rounds = 0.0, []
    for event in decoder.stream(pair, *_ids(pair, prompt), how, memory=scope):
        if isinstance(event, Finished):
            wall = event.stats.wall_s
        elif isinstance(event, Round):
            rounds.append(row(event))
    return wall, rounds


def row(event: Round) -> dict:
    return {
        "algorithm": event.algorithm,
        "k": event.k,
        "drafted": event.drafted,
        "accepted": event.accepted,
        "draft_s": event.draft_s,
        "verify_s": event.verify_s,
        "other_s": event.other_s,
        "sources": {s.name: [s.state.value, s.speedup] for s in event.sources},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="edits")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--algorithms", default="ngram,auto")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args()
    pair = usd.load_pair(precision="gguf", log=lambda *a: None)
    prompts = load_prompts(args.dataset, args.limit)
    algorithms = [Algorithm(a) for a in args.algorithms.split(",")]
    for a in algorithms:  # warm-up, remembered nowhere
        answer(pair, prompts[0], a, 8)
    memory, out, walls = SuffixMemory(), [], collections.Counter()
    for i, prompt in enumerate(prompts):
        for a in algorithms[i % len(algorithms) :] + algorithms[: i % len(algorithms)]:
            wall, rounds = answer(pair, prompt, a, args.max_new_tokens, memory.scope(pair.tokenizer_key, a.value))
            walls[a.value] += wall
            out.append({"prompt": prompt.id, "algorithm": a.value, "wall_s": wall, "rounds": rounds})
            modes = collections.Counter(r["algorithm"] for r in rounds)
            off = collections.Counter(r["sources"]["ngram"][0] for r in rounds if "ngram" in r["sources"])
            off.pop("in use", None)
            print(f"{prompt.id} {a.value}: {wall:.2f} s, rounds {dict(modes)}, ngram off: {dict(off)}", flush=True)
    print("total: " + ", ".join(f"{a} {s:.2f} s" for a, s in walls.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
