"""c and v(k) measured at load (usd/costs.py) on tiny random models: measured once and cached per machine, measured
again while the machine is busy, and read by auto, which then never drafts with the model from the first round where
no draft length of it can pay (its rounds say so) and never opens the drafter."""

from __future__ import annotations

import json

import pytest
import tiny_tokenizers as tiny
from tiny_pairs import how, tiny_pair

from usd import costs
from usd.algorithms import Algorithm
from usd.decoder import stream
from usd.events import Finished
from usd.memory import MEMORY_FORMAT, Learned, LoadCosts
from usd.pair import Pair
from usd.schedule import speedup_bound

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    t, d = tiny.target(), tiny.drafter_byte_level()
    target, drafter = tiny_pair(t, d, seed=0)
    return Pair(target, t, drafter, d, "tiny-target", "tiny-drafter")


def test_measured_once_then_read_from_the_cache(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "busy", lambda: False)
    first = costs.costs_for(pair, tmp_path, log=lambda *_: None)
    assert first.step_s > 0 and first.c > 0 and set(first.v) == {1, 2, 4, 8, 16}
    assert (tmp_path / costs.CACHE_FILE).is_file()

    def no_measuring(_):
        raise AssertionError("measured again although the cache holds this pair on this machine")

    monkeypatch.setattr(costs, "measure", no_measuring)
    again = costs.costs_for(pair, tmp_path, log=lambda *_: None)
    assert (again.step_s, again.c, again.v) == (first.step_s, first.c, first.v)


def test_a_busy_machine_measures_but_does_not_cache(pair, tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(costs, "busy", lambda: True)
    assert costs.costs_for(pair, tmp_path, log=said.append).c > 0
    assert not (tmp_path / costs.CACHE_FILE).exists() and "busy" in said[0]


def test_a_broken_cache_entry_is_measured_again(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "busy", lambda: False)
    broken = {costs.machine_key(pair): {"step_s": -1, "c": "x", "v": {}}}
    (tmp_path / costs.CACHE_FILE).write_text(json.dumps(broken))
    assert costs.costs_for(pair, tmp_path, log=lambda *_: None).step_s > 0


def test_the_tli_ceiling_is_looked_up_only_where_full_acceptance_could_pay(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "busy", lambda: False)
    monkeypatch.setattr(costs, "measure", lambda _: LoadCosts(0.03, 0.3, {1: 1.8, 2: 2.5, 4: 4.1}, feed=0.01))
    assert costs.costs_for(pair, tmp_path, log=lambda *_: None).tli_ceiling is None
    monkeypatch.setattr(costs, "measure", lambda _: LoadCosts(0.03, 0.05, {1: 1.1, 2: 1.2, 4: 1.4}, feed=0.01))
    ceiling = costs.costs_for(pair, tmp_path / "gpu", log=lambda *_: None).tli_ceiling
    assert ceiling is not None and 0 < ceiling <= 1


def test_auto_never_drafts_with_the_model_where_it_cannot_pay_and_says_why_from_the_first_round(pair):
    """Only the lookups, whose drafts cost nothing, may still speculate there (where the answer repeats the prompt)."""
    c, v = 0.3, {1: 1.8, 2: 2.5, 4: 4.1}
    pair.memory.clear()
    pair.memory.costs = LoadCosts(step_s=0.03, c=c, v=v, feed=0.01)
    ids = pair.target_tokenizer.encode("def fibonacci(n):")
    drafter_calls = []
    hook = pair.drafter.register_forward_hook(lambda *_: drafter_calls.append(1))
    try:
        events = list(stream(pair, ids, None, how(algorithm="auto", max_new_tokens=12)))
    finally:
        hook.remove()
    rounds, done = events[:-1], events[-1]
    assert isinstance(done, Finished) and set(done.stats.drafted_by_algorithm) <= {"ngram", "suffix"}
    assert {r.algorithm for r in rounds} <= {"none", "ngram", "suffix"}
    k, bound = speedup_bound(c, v)
    assert all(
        r.bound is not None and (r.bound.k, r.bound.speedup) == (k, bound) for r in rounds if r.algorithm == "none"
    )
    assert not drafter_calls, "the drafter was run (its prompt prefilled) although auto never drafts"


def test_timings_are_kept_apart_per_cpu_and_per_page_size(pair, monkeypatch):
    """One host name has had different CPUs from session to session, and huge pages change a step's cost: a cache
    entry from another CPU or page size must not decide auto's bound here."""
    keys = set()
    for cpu in ("Intel(R) Xeon(R) Processor", "AMD EPYC 9R14 96-Core Processor"):
        for huge in (True, False):
            monkeypatch.setattr(costs, "cpu_name", lambda cpu=cpu: cpu)
            monkeypatch.setattr(costs, "huge_pages_in_use", lambda huge=huge: huge)
            keys.add(costs.machine_key(pair))
    assert len(keys) == 4


def test_what_auto_learned_while_decoding_is_kept_for_the_next_process_on_this_machine(pair, tmp_path):
    """The load's timings promise a gain (c 0.14, v(1) 1.53), the loop measures a loss (c 0.30, v(1) 2.06, v(4)
    4.1): a restart reads what the loop learned, so its auto leaves the drafter model out from the first round instead
    of trying it again; a damaged entry is not used."""
    from usd.record import RoundRecord
    from usd.schedule import Schedule

    def restarted() -> Pair:
        fresh = Pair(pair.target, pair.target_tokenizer, pair.drafter, pair.drafter_tokenizer, *names)
        fresh.memory.costs = LoadCosts.from_json(at_load)
        costs.restore_learned(fresh, tmp_path)
        return fresh

    names, step = ("tiny-target", "tiny-drafter"), 0.03
    at_load = {"step_s": step, "c": 0.14, "v": {"1": 1.53, "2": 1.9, "4": 2.6}, "feed": 0.01}
    first = restarted()
    assert first.memory.schedule == Learned() and Schedule(first, Algorithm.AUTO, "auto").bound is None
    s = Schedule(first, Algorithm.AUTO, "auto")
    for _ in range(5):
        s.observe(RoundRecord("none", 0, 0, 0, verify_s=step))
        s.observe(RoundRecord("tli", 1, 1, 0, draft_steps=1, draft_s=0.30 * step, verify_s=2.06 * step))
        s.observe(RoundRecord("tli", 4, 4, 0, draft_steps=4, draft_s=4 * 0.30 * step, verify_s=4.1 * step))
    costs.remember(first)

    second = Schedule(restarted(), Algorithm.AUTO, "auto")
    assert second.bound is not None and second.bound.measured == "while decoding"
    assert (second.bound.c, second.modes) == (pytest.approx(0.30), ["none"])

    learned_key = costs.machine_key(first) + costs.LEARNED
    cache = tmp_path / costs.CACHE_FILE
    damaged = json.loads(cache.read_text())
    damaged[learned_key]["steps"] = {"0": ["x"]}
    cache.write_text(json.dumps(damaged))
    assert restarted().memory.schedule == Learned()


def test_what_auto_learned_reads_back_as_kept_and_another_layout_or_a_damaged_one_is_not_read():
    learned = Learned(steps={"0": [0.03, 0.031]}, verify={"0": {"3": [[0.05, 1.6], [0.06, None]]}}, observed=3)
    learned.mode("tli").rounds = 2
    learned.mode("tli").hits[:] = [1.5, 2.0]
    learned.gap["tli"] = 32
    doc = json.loads(json.dumps(learned.to_json()))
    assert Learned.from_json(doc) == learned
    assert Learned.from_json({**doc, "format": MEMORY_FORMAT - 1}) is None, "an older version's layout was read"
    assert Learned.from_json({k: v for k, v in doc.items() if k != "format"}) is None
    assert Learned.from_json({**doc, "modes": {"tli": {"rounds": 2, "speed": [1, 1]}}}) is None
    assert Learned.from_json({**doc, "gap": {"not-a-mode": 3}}) is None
    assert Learned.from_json({**doc, "feed": [1.0, float("nan")]}) is None
    assert Learned.from_json(None) is None
