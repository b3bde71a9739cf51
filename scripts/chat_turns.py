"""Write a prompt set of chat turns for `usd bench --dataset FILE`: MT-Bench's second turns, each after the first turn
and the target's own plain greedy answer to it (so the conversation is one the target could have had), and first
turns in other scripts, with emoji and with whitespace-heavy text. auto has to decide quickly there that speculation
does not pay (issue 41).

    PYTHONPATH=. python scripts/chat_turns.py docs/bench/chat-turns.jsonl [--limit 8] [--first-answer-tokens 64]
"""

from __future__ import annotations

import argparse
import json

from usd import api
from usd.datasets import _mtbench_rows
from usd.events import Finished

CHAT_CATEGORIES = ("writing", "roleplay", "stem", "humanities")
SCRIPTS = (
    "Écris un court paragraphe sur la Loire et ses châteaux, en français.",
    "用中文写三句话，介绍一下长城的历史。",
    "Напиши короткое стихотворение о зиме на русском языке.",
    "日本の四季について、短く説明してください。",
    "Reply only with emoji: describe a day at the beach 🏖️ from morning to night.",
    "Format this as an aligned plain-text table with spaces, no Markdown:\n"
    "name    age   city\nAnn 34 Oslo\nBartholomew   7 Rio de Janeiro\nCy 101    Ulm",
)


def second_turns(pair, limit: int, first_tokens: int) -> list[dict]:
    rows = [r for r in _mtbench_rows() if r.get("category") in CHAT_CATEGORIES and len(r["turns"]) > 1][:limit]
    out = []
    for r in rows:
        first = [{"role": "user", "content": r["turns"][0]}]
        events = api.stream(pair, messages=first, algorithm="none", max_new_tokens=first_tokens)
        answer = next(e for e in events if isinstance(e, Finished)).text
        turns = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": r["turns"][1]}]
        out.append({"id": f"mtbench-turn2/{r['question_id']}", "messages": turns})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--first-answer-tokens", type=int, default=64)
    args = p.parse_args()
    pair = api.load_pair()
    rows = second_turns(pair, args.limit, args.first_answer_tokens)
    rows += [{"id": f"scripts/{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(SCRIPTS)]
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(f"{len(rows)} prompts: {args.out}")


if __name__ == "__main__":
    main()
