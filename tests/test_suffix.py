"""The suffix source (usd/suffix.py): what it drafts from (the most frequent continuation of the longest match), its
memory bounded in bytes and kept per tokenizer and scope, output identical to plain decoding in every turn, and
scopes that never lend one visitor's answers to another's drafts."""

from __future__ import annotations

import gc
import tracemalloc
from array import array

import pytest
from tiny_pairs import how
from tiny_serving import served_pair

from usd import api, suffix
from usd.decoder import stream
from usd.events import Finished
from usd.suffix import KEY_TOKENS, Occurrence, SuffixMemory, Texts, continuation, parse_size


def occurrences(texts: list[list[int]], tail: list[int]) -> list[Occurrence]:
    memory = Texts()
    for i, ids in enumerate(texts):
        memory.add(i, array("i", ids))
    return memory.occurrences(tail)


def test_the_continuation_most_earlier_texts_share_is_drafted():
    earlier = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 7], [8, 2, 3, 4, 5, 6, 0]]
    assert continuation(occurrences(earlier, [2, 3, 4]), 8) == [5, 6, 0]  # 5 by all, 6 by two of three, 0 by one
    # the longest match decides the group: only the text that matches 1 2 3 4 goes on
    assert continuation(occurrences(earlier, [1, 2, 3, 4]), 8) == [5, 6]


def test_a_draft_stops_where_too_few_occurrences_agree_and_runs_longer_on_a_longer_match():
    split = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12], [1, 2, 3, 13]]
    assert continuation(occurrences(split, [1, 2, 3]), 8) == []  # each continuation is a quarter's
    long_run = list(range(100, 140))
    assert len(continuation(occurrences([long_run], long_run[:3]), 16)) == KEY_TOKENS
    assert continuation(occurrences([long_run], long_run[:12]), 16) == long_run[12:24]
    assert continuation(occurrences([long_run], long_run[:30]), 16) == long_run[30:40]  # to the text's end


def test_no_match_under_the_key_length_and_a_text_is_not_its_own_match():
    assert occurrences([[1, 2, 3, 4]], [3, 4]) == []
    assert occurrences([[1, 2, 3]], [1, 2, 3]) == []  # nothing followed 1 2 3 yet


def test_the_memory_stays_within_its_bound_evicting_the_oldest_answers_first():
    memory = SuffixMemory(bound=200_000)
    for i in range(400):
        where = ("tok", f"visitor {i % 3}")  # several scopes: the running total covers them all, compactions too
        memory.remember(where, [(i * 7 + j) % 5000 for j in range(100 + i % 50)])
        assert memory.nbytes == sum(t.nbytes for t in memory.scopes.values()) <= memory.bound
    where = ("tok", "visitor 1")
    kept = memory.scopes[where].texts
    assert 0 < len(kept) < 134 and max(kept) == 398 and min(kept) > 1
    memory.resize(0)
    assert memory.nbytes == 0 and not memory.scopes


def test_what_the_memory_counts_covers_what_python_spends_on_it():
    """The bound is honest: the bytes tracemalloc sees a memory's texts and index take are at most what it counts."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    memory = SuffixMemory(bound=1 << 30)
    for i in range(300):
        memory.remember(("tok", "s"), [(i * 131 + j * 17) % 150_000 for j in range(200)])
    spent = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert spent <= memory.nbytes, f"spent {spent:,} bytes, counted {memory.nbytes:,}"
    assert memory.nbytes < 2 * spent  # and not so generous that the bound means little


@pytest.mark.parametrize(
    ("text", "size"), [("64MiB", 64 << 20), ("512KB", 512_000), ("1g", 1 << 30), ("0", 0), ("2048", 2048)]
)
def test_memory_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "64 parsecs", "1.5GB", "9999TB"])
def test_a_bad_memory_size_says_what_to_give(text):
    with pytest.raises(ValueError, match="suffix memory"):
        parse_size(text)


def test_a_bad_memory_option_is_a_clear_error_at_start(capsys):
    from usd.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--suffix-memory", "lots"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "suffix memory 'lots' is not a size" in err and "Traceback" not in err


# --- through the engine ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return served_pair()[0]


def answer(pair, prompt: str, algorithm: str, memory) -> Finished:
    ids = pair.target_tokenizer.encode(prompt)
    *_, done = stream(
        pair, ids, None, how(algorithm=algorithm, k=8, max_new_tokens=40), memory=memory, probe_first=False
    )
    return done


def drafted_from(done: Finished) -> int:
    return done.stats.drafted_by_algorithm.get("suffix", 0)


def test_an_answer_asked_for_again_is_drafted_from_memory_and_stays_the_targets(pair):
    """The second time a prompt is asked, in a new conversation, its earlier answer is drafted and kept; every
    answer equals plain decoding's."""
    scope = SuffixMemory().scope(pair.tokenizer_key, "a")
    plain = answer(pair, "def add(a, b):", "none", None)
    first = answer(pair, "def add(a, b):", "suffix", scope)
    again = answer(pair, "def add(a, b):", "suffix", scope)
    assert first.target_ids == again.target_ids == plain.target_ids
    assert again.stats.accepted > first.stats.accepted and again.stats.rounds < first.stats.rounds


def test_visitor_b_never_drafts_from_visitor_a_s_answers(pair):
    """B's rounds are exactly what they are where A never asked: same drafts, same count, whatever A's answers held
    (here A asked B's very question, so drafting from A's memory would show at once)."""
    alone = SuffixMemory()
    b_alone = answer(pair, "def add(a, b):", "suffix", alone.scope(pair.tokenizer_key, "b"))
    shared = SuffixMemory()
    answer(pair, "def add(a, b):", "suffix", shared.scope(pair.tokenizer_key, "a"))
    b_after_a = answer(pair, "def add(a, b):", "suffix", shared.scope(pair.tokenizer_key, "b"))
    assert b_after_a.target_ids == b_alone.target_ids
    assert (b_after_a.stats.drafted, b_after_a.stats.accepted) == (b_alone.stats.drafted, b_alone.stats.accepted)
    assert drafted_from(answer(pair, "def add(a, b):", "suffix", shared.scope(pair.tokenizer_key, "a"))) > 0


def test_a_keyed_server_keeps_memory_per_key_and_an_unkeyed_one_shares_the_local_scope(pair):
    from usd.serve import FixedPair

    keyed, other = FixedPair(pair, api_key="k1"), FixedPair(pair, api_key="k2")
    assert keyed.memory_scope != other.memory_scope and "k1" not in keyed.memory_scope
    assert FixedPair(pair).memory_scope == suffix.LOCAL


def test_every_turn_equals_plain_whatever_earlier_turns_used(pair, monkeypatch):
    """A conversation whose turns alternate suffix, auto and plain decoding, the memory filling as it goes."""
    monkeypatch.setattr(suffix, "MEMORY", SuffixMemory())
    messages: list[dict] = []
    for turn, algorithm in enumerate(["suffix", "auto", "none", "suffix"]):
        messages.append({"role": "user", "content": f"add {turn % 2}"})
        done = api.generate(pair, messages=messages, algorithm=algorithm, max_new_tokens=12)
        plain = api.generate(pair, messages=messages, algorithm="none", max_new_tokens=12, scope=None)
        assert done.target_ids == plain.target_ids, f"turn {turn} ({algorithm})"
        messages.append({"role": "assistant", "content": done.text})


def test_a_server_s_memory_stays_within_its_bound_request_after_request(pair, monkeypatch):
    """scripts/suffix_soak.py in small: requests through `usd serve`'s routes, each a new answer to remember, with the
    bound set low; the memory never counts more than its bound, and the oldest answers make room."""
    import httpx
    from tiny_serving import new_answer_request, serving

    from usd.serve import FixedPair, Slots, create_app

    memory = SuffixMemory(bound=8 << 10)
    monkeypatch.setattr(suffix, "MEMORY", memory)
    most = 0
    with serving(create_app(FixedPair(pair, slots=Slots(1, 4)))) as root, httpx.Client(timeout=60) as client:
        for i in range(150):
            client.post(f"{root}/v1/chat/completions", json=new_answer_request(pair, i)).raise_for_status()
            most = max(most, memory.nbytes)
    assert 0 < most <= memory.bound
    assert min(memory.order) > 1, "the oldest answers should have made room"
