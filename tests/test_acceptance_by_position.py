"""scripts/acceptance_by_position.py's arithmetic on made-up rounds: the counts by position, the two fits, and which
model's expected tokens a round match what the rounds emitted. No models needed."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "acceptance_by_position.py"


def load_script():
    spec = importlib.util.spec_from_file_location("acceptance_by_position", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rounds_in(first: float, then: float, n: int = 4000) -> list[dict]:
    """Rounds of every k whose first candidate is accepted with `first`, each later one with `then`."""
    rng, rounds = random.Random(0), []
    for k in range(1, 9):
        for _ in range(n):
            accepted = 0
            while accepted < k and rng.random() < (first if accepted == 0 else then):
                accepted += 1
            rounds.append({"k": k, "drafted": k, "accepted": accepted})
    return rounds


def test_only_tested_candidates_count():
    mod = load_script()
    rounds = [
        {"k": 3, "drafted": 3, "accepted": 1},
        {"k": 3, "drafted": 3, "accepted": 3},
        {"k": 1, "drafted": 1, "accepted": 0},
    ]
    assert mod.by_position(rounds) == [(2, 3), (1, 2), (1, 1)]
    assert mod.fit(rounds) == {"pooled": 4 / 6, "first": 2 / 3, "then": 2 / 3}


def test_the_model_that_matches_the_world_predicts_better():
    mod = load_script()
    alike = mod.compare(rounds_in(0.6, 0.6))["fits"]["every k"]
    assert alike["first"] == pytest.approx(0.6, abs=0.02) and alike["then"] == pytest.approx(0.6, abs=0.02)
    assert alike["pooled_error"] < 0.03 and alike["first_then_error"] < 0.03
    apart = mod.compare(rounds_in(0.4, 0.9))["fits"]["every k"]
    assert apart["first_then_error"] < 0.05 < 0.2 < apart["pooled_error"]
