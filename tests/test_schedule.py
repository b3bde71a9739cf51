"""auto's schedule and cost model in made-up worlds: every mode is tried, the model picks the (mode, k) the formula
says, it decodes plainly where every k loses and probes the others with a growing wait, switches when the world
changes, and remembers across generations. No models needed."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from usd.schedule import K_MAX, K_START, MIN_TRIES, PROBE_BUDGET, PROBE_EVERY, CostModel, Schedule, tau


def fake_pair(same_tokenizer=False):
    return SimpleNamespace(same_tokenizer=same_tokenizer, memory={})


@dataclass
class World:
    """A machine and a pair: the target's forward over n positions costs verify(n) seconds, a drafter step
    `draft[mode]` seconds, and each drafted token is accepted with probability `alpha[mode]`."""

    alpha: dict
    draft: dict
    verify: object = lambda n: 1.0 + 0.05 * (n - 1)
    setup: float = 0.0
    """What a drafter's catching up costs before a speculative round that follows plain ones (outside its time)."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    spent: float = 0.0
    last: str = "none"

    def round(self, schedule: Schedule) -> tuple[str, int]:
        mode, k = schedule.next()
        setup_s, self.last = (self.setup if mode != "none" and self.last == "none" else 0.0), mode
        if mode == "none":
            schedule.observe(mode, 0, 0, 0, 1, self.verify(1), verify_s=self.verify(1))
            self.spent += self.verify(1)
            return mode, k
        accepted = 0
        while accepted < k and self.rng.random() < self.alpha[mode]:
            accepted += 1
        draft_s, verify_s = k * self.draft[mode], self.verify(k + 1)
        schedule.observe(
            mode,
            k,
            k,
            accepted,
            accepted + 1,
            draft_s + verify_s,
            draft_s=draft_s,
            draft_steps=k,
            verify_s=verify_s,
            setup_s=setup_s,
        )
        self.spent += setup_s + draft_s + verify_s
        return mode, k

    def run(self, schedule: Schedule, rounds: int) -> list[tuple[str, int]]:
        return [self.round(schedule) for _ in range(rounds)]


def best_by_formula(world: World, mode: str) -> tuple[int, float]:
    rates = {k: tau(world.alpha[mode], k) / (k * world.draft[mode] + world.verify(k + 1)) for k in range(1, K_MAX + 1)}
    k = max(rates, key=rates.get)
    return k, rates[k]


PAYS = dict(alpha={"tli": 0.8, "slem": 0.6}, draft={"tli": 0.1, "slem": 0.1})
LOSES = dict(alpha={"tli": 0.4, "slem": 0.3}, draft={"tli": 0.45, "slem": 0.45}, verify=lambda n: 0.9 * n + 0.1)


def test_probe_round_first_then_every_mode_is_tried():
    chosen = [m for m, _ in World(**PAYS).run(Schedule(fake_pair(), "auto", "auto"), 1 + 3 * MIN_TRIES)]
    assert chosen[0] == "none"
    assert all(chosen.count(m) >= MIN_TRIES for m in ("none", "tli", "slem"))


def test_the_cost_model_picks_the_k_the_formula_says():
    model = CostModel({})
    world = World(alpha={"tli": 0.7}, draft={"tli": 0.08}, verify=lambda n: 1.0 + 0.12 * (n - 1) ** 1.3)
    for n in range(1, K_MAX + 2):  # every length measured once, exactly
        model.observe("none" if n == 1 else "tli", n - 1, 0, 0.0, 0, world.verify(n), 0.0)
    for _ in range(200):  # acceptance: 70% of tested positions
        model.observe("tli", 0, 0, 0.0, 0, world.verify(1), 0.0)
    model.modes["tli"]["hits"] = [0.7, 1.0]
    model.modes["tli"]["draft"] = [0.08, 1.0]
    model.modes["tli"]["other"] = [0.0, 1.0]
    k, rate = model.best_k("tli")
    assert (k, rate) == (best_by_formula(world, "tli")[0], pytest.approx(best_by_formula(world, "tli")[1]))
    assert model.expected_speedup("tli", k) == pytest.approx(rate * world.verify(1))


def test_speculates_at_the_best_k_where_it_pays():
    s = Schedule(fake_pair(), "auto", "auto")
    chosen = World(**PAYS).run(s, 300)[100:]
    assert [m for m, _ in chosen].count("tli") / len(chosen) > 0.85
    k_best, _ = best_by_formula(World(**PAYS), "tli")
    ks = [k for m, k in chosen if m == "tli"]
    assert abs(sorted(ks)[len(ks) // 2] - k_best) <= 1
    assert s.expected_speedup is None or s.expected_speedup > 0


def test_falls_back_to_plain_when_every_k_loses_and_probes_less_and_less():
    world = World(**LOSES)
    assert all(best_by_formula(world, m)[1] < 1 / world.verify(1) for m in ("tli", "slem"))  # every k loses
    chosen = [m for m, _ in world.run(Schedule(fake_pair(), "auto", "auto"), 3000)]
    settled = chosen[1 + 3 * MIN_TRIES :]
    assert settled.count("none") / len(settled) > 0.99
    for algorithm in ("tli", "slem"):
        probes = [i for i, m in enumerate(settled) if m == algorithm]
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[0] >= PROBE_EVERY  # the wait never shrinks


def test_probing_a_mode_whose_drafter_must_catch_up_costs_at_most_the_probing_budget():
    """A probe that costs far more than its round (the drafter's prefill) waits until it is PROBE_BUDGET of the time."""
    world = World(**LOSES, setup=8.0)  # a wait of about 900 rounds: under PROBE_BUDGET_MAX
    s = Schedule(fake_pair(), "auto", "auto")
    world.run(s, 200)  # settled: every k loses
    spent_before, tokens = world.spent, 4000
    world.run(s, tokens)
    plain_only = tokens * world.verify(1)  # a speculative round emits at least one token: this bounds the time saved
    assert (world.spent - spent_before) / plain_only < 1 + 2 * PROBE_BUDGET * 2  # two modes watched


def test_a_fixed_algorithm_that_lost_is_not_probed_at_once_by_auto():
    """The pair's memory carries what a tli generation cost, its drafter's prefill included (paid in its first round,
    before the mode could be judged): auto starts with the wait that pays that off, not with a probe."""
    pair, world = fake_pair(), World(**LOSES, setup=8.0)
    world.run(Schedule(pair, "none", 0), 20)
    world.run(Schedule(pair, "tli", "auto"), 40)
    chosen = [m for m, _ in world.run(Schedule(pair, "auto", "auto"), 700)]
    assert "tli" not in chosen[:600]  # about 900 rounds: 9 plain rounds of excess at 1%


def test_a_plain_round_names_the_speculation_it_declined_and_why():
    s = Schedule(fake_pair(), "auto", "auto")
    world = World(**LOSES)
    world.run(s, 200)
    mode, _ = world.round(s)
    while mode != "none":
        mode, _ = world.round(s)
    algorithm, k, speedup = s.declined
    assert algorithm in ("tli", "slem") and speedup < 1, "every k loses here: the best option is below plain"
    assert speedup == pytest.approx(s.model.expected_speedup(algorithm, k))
    s = Schedule(fake_pair(), "auto", "auto")
    world = World(**PAYS)
    world.run(s, 200)
    assert s.next()[0] != "none" and s.declined is None


def test_switches_to_the_algorithm_that_wins_and_back():
    pair = fake_pair()
    s = Schedule(pair, "auto", "auto")
    chosen = [m for m, _ in World(**PAYS).run(s, 120)]
    assert chosen[-20:].count("tli") >= 18
    # later the drafter stops paying (say the text changed): auto notices at the next probes and goes plain
    chosen = [m for m, _ in World(**LOSES).run(s, 200)]
    assert chosen[-20:].count("none") >= 18


def test_memory_carries_over_to_the_next_generation_of_the_pair():
    pair = fake_pair()
    World(**PAYS).run(Schedule(pair, "auto", "auto"), 60)
    chosen = [m for m, _ in World(**PAYS).run(Schedule(pair, "auto", "auto"), 6)]
    assert chosen[0] == "none" and chosen[1:] == ["tli"] * 5  # no re-exploration after the probe step


def test_identical_tokenizers_choose_between_plain_and_standard():
    world = World(alpha={"standard": 0.8}, draft={"standard": 0.1})
    assert {m for m, _ in world.run(Schedule(fake_pair(same_tokenizer=True), "auto", 4), 30)} == {"none", "standard"}


def test_fixed_algorithm_and_k_stay_fixed():
    chosen = World(**LOSES).run(Schedule(fake_pair(), "slem", 3), 10)
    assert chosen[0] == ("none", 0) and set(chosen[1:]) == {("slem", 3)}


def test_adaptive_k_starts_at_k_start_then_follows_the_model():
    s = Schedule(fake_pair(), "tli", "auto", probe_first=False)
    assert s.min_confidence > 0
    generous = World(alpha={"tli": 0.97}, draft={"tli": 0.02})
    ks = [k for _, k in generous.run(s, 40)]
    assert ks[:MIN_TRIES] == [K_START] * MIN_TRIES and ks[-1] == best_by_formula(generous, "tli")[0] == K_MAX
    stingy = World(alpha={"tli": 0.1}, draft={"tli": 0.3})
    ks = [k for _, k in stingy.run(s, 60)]
    assert ks[-1] == 1


def test_a_seeded_rejection_sampling_run_drafts_a_length_no_timing_can_change():
    """A seed must fix tli's sample, and its draws depend on where rounds are cut: k may not follow wall-clock times."""
    s = Schedule(fake_pair(), "tli", "auto", probe_first=False, seeded_sampling=True)
    generous = World(alpha={"tli": 0.97}, draft={"tli": 0.02})
    assert {k for _, k in generous.run(s, 30)} == {K_START} and s.min_confidence > 0
