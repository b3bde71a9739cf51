"""The n-gram lookup (usd/ngram.py): the longest suffix first, its most recent earlier occurrence, never the suffix
itself, and an index that grows with the ids instead of scanning them."""

from __future__ import annotations

import random

import pytest

from usd.ngram import NgramIndex


def scan(ids: list[int], k: int, n_min: int, n_max: int):
    """The same lookup by brute force over the whole sequence, as a reference."""
    for n in range(min(n_max, len(ids)), n_min - 1, -1):
        for end in range(len(ids) - 1, n - 1, -1):  # the occurrence ending latest that has an id after it
            if ids[end - n : end] == ids[-n:]:
                return ids[end : end + k], end, n
    return None


def test_the_longest_match_and_its_latest_occurrence():
    index = NgramIndex([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3], n_min=1, n_max=3)
    found = index.lookup(2)
    assert (found.candidates, found.source, found.n) == ([9, 2], 3, 3)  # "1 2 3" before, followed by 9 2
    index.extend([7])
    found = index.lookup(3)
    assert (found.candidates, found.n) == ([8, 1, 2], 3)  # "2 3 7" matched, then what came after it


def test_no_match_and_the_suffix_is_not_its_own_match():
    assert NgramIndex([5, 6, 7], n_min=2).lookup(4) is None
    assert NgramIndex([4, 4], n_min=2).lookup(3) is None  # the only "4 4" is the suffix itself
    found = NgramIndex([4, 4, 4], n_min=2).lookup(3)
    assert (found.candidates, found.source) == ([4], 2)  # an overlapping repeat: what followed the first "4 4"


@pytest.mark.parametrize("seed", range(5))
def test_the_index_finds_what_a_scan_finds_as_ids_are_appended(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex(n_min=2, n_max=4)
    for i, token in enumerate(ids):
        index.extend([token])
        found = index.lookup(3)
        want = scan(ids[: i + 1], 3, 2, 4)
        assert (found.candidates, found.source, found.n) == want if found else want is None, i


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramIndex(n_min=3, n_max=2)


def test_the_edits_set_pastes_each_solution_with_an_edit_in_turn():
    from usd.datasets import EDITS, edit_prompts

    rows = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n", "canonical_solution": "    return x\n"}
        for i in range(5)
    ]
    prompts = edit_prompts(rows)
    assert [p.id for p in prompts] == [f"edits/HumanEval/{i}" for i in range(5)]
    for i, p in enumerate(prompts):
        (message,) = p.messages
        assert message["role"] == "user" and f"```python\ndef f{i}(x):\n    return x\n```" in message["content"]
        assert EDITS[i % len(EDITS)] in message["content"]


def test_the_edits_set_holds_code_edits_and_document_questions_in_turn():
    """Two code edits, then one of MT-Bench's extraction questions (a pasted text to answer from), from the pinned
    packages, so that a --limit of the set holds both."""
    from usd.datasets import load_prompts

    prompts = load_prompts("edits", limit=9)
    kinds = ["document" if "/mtbench/" in p.id else "code" for p in prompts]
    assert kinds == ["code", "code", "document"] * 3
    assert len(load_prompts("edits")) == 164 + 10  # every HumanEval task and every extraction question
