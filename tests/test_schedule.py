"""auto's schedule on made-up costs: it tries every mode, settles on the cheapest, keeps probing the others with a
growing gap, switches when the costs change, and adapts k. No models needed."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from usd.schedule import K_MAX, K_START, MIN_TRIES, PROBE_EVERY, Schedule


def fake_pair(same_tokenizer=False):
    return SimpleNamespace(same_tokenizer=same_tokenizer, memory={})


def drive(schedule, cost_per_token, rounds):
    """Run `rounds` rounds where mode m emits 2 tokens at cost_per_token[m] seconds each; return the modes chosen."""
    chosen = []
    for _ in range(rounds):
        mode, k = schedule.next()
        chosen.append(mode)
        schedule.observe(mode, k, 0 if mode == "none" else k, 1, 2, 2 * cost_per_token[mode])
    return chosen


def test_probe_round_first_then_every_mode_is_tried():
    s = Schedule(fake_pair(), "auto", 4)
    chosen = drive(s, {"none": 1.0, "tli": 2.0, "slem": 3.0}, 1 + 3 * MIN_TRIES)
    assert chosen[0] == "none"
    assert all(chosen.count(m) >= MIN_TRIES for m in ("none", "tli", "slem"))


def test_falls_back_to_plain_when_speculation_loses_and_probes_less_and_less():
    s = Schedule(fake_pair(), "auto", 4)
    chosen = drive(s, {"none": 1.0, "tli": 1.5, "slem": 1.3}, 400)
    settled = chosen[1 + 3 * MIN_TRIES :]
    assert settled.count("none") / len(settled) > 0.97
    for algorithm in ("tli", "slem"):
        probes = [i for i, m in enumerate(settled) if m == algorithm]
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        assert len(gaps) >= 2 and gaps[-1] > gaps[0] >= PROBE_EVERY  # the wait grows while it keeps losing


def test_switches_to_the_algorithm_that_wins_and_back():
    pair = fake_pair()
    s = Schedule(pair, "auto", 4)
    chosen = drive(s, {"none": 1.0, "tli": 0.5, "slem": 0.8}, 60)
    assert chosen[-20:].count("tli") >= 18
    # later the drafter stops paying (say the text changed): auto notices at the next probes and goes plain
    chosen = drive(s, {"none": 1.0, "tli": 3.0, "slem": 3.0}, 80)
    assert chosen[-20:].count("none") >= 18


def test_memory_carries_over_to_the_next_generation_of_the_pair():
    pair = fake_pair()
    drive(Schedule(pair, "auto", 4), {"none": 1.0, "tli": 0.5, "slem": 0.8}, 40)
    chosen = drive(Schedule(pair, "auto", 4), {"none": 1.0, "tli": 0.5, "slem": 0.8}, 6)
    assert chosen[0] == "none" and chosen[1:] == ["tli"] * 5  # no re-exploration after the probe step


def test_identical_tokenizers_choose_between_plain_and_standard():
    s = Schedule(fake_pair(same_tokenizer=True), "auto", 4)
    assert set(drive(s, {"none": 1.0, "standard": 0.5}, 30)) == {"none", "standard"}


def test_fixed_algorithm_and_k_stay_fixed():
    s = Schedule(fake_pair(), "slem", 3)
    chosen = []
    for _ in range(10):
        mode, k = s.next()
        chosen.append((mode, k))
        s.observe(mode, k, k, 0, 1, 1.0)
    assert chosen[0] == ("none", 0) and set(chosen[1:]) == {("slem", 3)}


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_none():
    s = Schedule(fake_pair(), "tli", "auto", probe_first=False)
    assert s.min_confidence > 0
    ks = []
    for _ in range(K_MAX + 2):
        mode, k = s.next()
        ks.append(k)
        s.observe(mode, k, k, k, k + 1, 1.0)  # everything accepted
    assert ks[0] == K_START and max(ks) == K_MAX and ks == sorted(ks)
    for _ in range(K_MAX + 2):
        mode, k = s.next()
        s.observe(mode, k, k, 0, 1, 1.0)  # nothing accepted
    assert s.next()[1] == 1
