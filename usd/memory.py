"""What outlives single generations of a pair: the costs timed at load, what auto measured while decoding, and how
each drafter prompt rendering fared. Typed here; JSON only where the cost cache keeps them across processes
(`to_json`, and `from_json`, which refuses another layout or a damaged file)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .algorithms import NAMES

MEMORY_FORMAT = 2
"""The layout of what auto learns (`Learned`): the cost cache keeps it across processes, and a file of another layout
(an older version's) is not read."""


def _numbers(xs) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


def _cell() -> list[float]:
    return [0.0, 0.0]


@dataclass
class LoadCosts:
    """A pair's costs timed at load (usd/costs.py), auto's prior: the target's step in seconds, the drafter's step
    over it (c), the target's forward over k + 1 positions over its step (v(k), by k) and the drafter's catching up per
    position over the step (feed); and tli's acceptance ceiling where a full acceptance could pay."""

    step_s: float
    c: float
    v: dict[int, float]
    feed: float
    tli_ceiling: float | None = None

    def to_json(self) -> dict:
        """What the cost cache keeps (k as a string, for JSON; the ceiling is the vocabulary's, worked out anew)."""
        return {"step_s": self.step_s, "c": self.c, "v": {str(k): x for k, x in self.v.items()}, "feed": self.feed}

    @classmethod
    def from_json(cls, doc) -> LoadCosts | None:
        """The costs a cache file holds, or None where they are not all there and positive."""
        try:
            costs = cls(
                float(doc["step_s"]),
                float(doc["c"]),
                {int(k): float(x) for k, x in doc["v"].items()},
                float(doc["feed"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        numbers = [costs.step_s, costs.c, costs.feed, *costs.v.values()]
        positive = costs.step_s > 0 and costs.feed > 0 and costs.c >= 0 and all(x > 0 for x in costs.v.values())
        return costs if positive and all(math.isfinite(x) for x in numbers) and costs.v else None


@dataclass
class ModeStats:
    """What the loop measured of one mode, each a decayed running mean kept as [sum, weight] (`schedule.Mean`): the
    drafter's step in seconds (draft) and over the plain step near it (c), the rest of a round (other), acceptance per
    tested position (hits); and the rounds observed."""

    draft: list[float] = field(default_factory=_cell)
    c: list[float] = field(default_factory=_cell)
    other: list[float] = field(default_factory=_cell)
    hits: list[float] = field(default_factory=_cell)
    rounds: int = 0

    def cells(self) -> list[list[float]]:
        return [self.draft, self.c, self.other, self.hits]


@dataclass
class Learned:
    """What auto measured while decoding a pair (`schedule.CostModel`, `schedule.Schedule`), kept per pair and CPU
    across restarts (`costs.remember`). Keyed by data only: cache-length buckets and draft lengths as strings (JSON's
    keys), modes by their names."""

    steps: dict[str, list[float]] = field(default_factory=dict)
    """Length bucket -> seconds of its last WINDOW one-position forwards."""
    verify: dict[str, dict[str, list]] = field(default_factory=dict)
    """Bucket -> positions fed -> the last WINDOW [seconds, seconds over the step near it (None: no step yet)]."""
    modes: dict[str, ModeStats] = field(default_factory=dict)
    feed: list[float] = field(default_factory=_cell)
    """The drafter catching up, per position, over the step: a running mean."""
    observed: int = 0
    """Rounds observed, by any generation of the pair."""
    gap: dict[str, int] = field(default_factory=dict)
    """Mode -> rounds to wait before probing it again."""
    since: dict[str, int] = field(default_factory=dict)
    """Mode -> rounds since it last ran, counted across generations (a probe costs a drafter's prefill and catch-up,
    so a count restarted per generation would probe in every answer)."""
    setup_s: dict[str, float] = field(default_factory=dict)
    """Mode -> setup seconds its next wait has yet to pay off."""
    answer_tokens: list[float] = field(default_factory=_cell)
    """The pair's answer lengths: a running mean."""
    last_answer: int = 0
    """Tokens of the answer in progress, or of the last one until the next answer folds it into `answer_tokens`."""

    def mode(self, name: str) -> ModeStats:
        return self.modes.setdefault(name, ModeStats())

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "format": MEMORY_FORMAT}

    @classmethod
    def from_json(cls, doc) -> Learned | None:
        """What a cache file holds, or None where it has another layout (an older version's) or is damaged: the pair
        then starts from what was measured at load."""
        try:
            if doc["format"] != MEMORY_FORMAT:
                return None
            fields = {f.name for f in dataclasses.fields(cls)} - {"modes"}
            modes = {name: ModeStats(**m) for name, m in doc.get("modes", {}).items()}
            learned = cls(**{k: v for k, v in doc.items() if k in fields}, modes=modes)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return learned if learned._valid() else None

    def _valid(self) -> bool:
        try:
            cells = [self.feed, self.answer_tokens, *(c for m in self.modes.values() for c in m.cells())]
            verifies = [cell for by_n in self.verify.values() for window in by_n.values() for cell in window]
            keys = [*self.steps, *self.verify, *(n for by_n in self.verify.values() for n in by_n)]
            named = [*self.modes, *self.gap, *self.since, *self.setup_s]
            return (
                isinstance(self.observed, int)
                and all(isinstance(key, str) and key.isdigit() for key in keys)
                and all(name in NAMES for name in named)
                and all(_numbers(xs) for xs in self.steps.values())
                and all(_numbers(cell) and len(cell) == 2 for cell in cells)
                and all(isinstance(m.rounds, int) for m in self.modes.values())
                and all(_numbers([t]) and (r is None or _numbers([r])) for t, r in verifies)
                and all(_numbers(list(d.values())) for d in (self.gap, self.since, self.setup_s))
                and _numbers([self.last_answer])
            )
        except (TypeError, ValueError, AttributeError):
            return False


@dataclass
class RenderingTally:
    """How one drafter prompt rendering fared: generations that drafted with it, and their accepted and drafted
    tokens."""

    generations: int = 0
    accepted: int = 0
    drafted: int = 0


@dataclass
class PairMemory:
    """What outlives single generations of a pair in this process, and what auto plans with."""

    costs: LoadCosts | None = None
    """The costs measured at load (`costs.costs_for`): auto's prior."""
    schedule: Learned = field(default_factory=Learned)
    """What auto measured while decoding: kept per pair and CPU across restarts (`costs.remember`)."""
    learned_at: tuple[Path | None, str] | None = None
    """Where `schedule` is kept across restarts: (cost cache file, key) (`costs.restore_learned`)."""
    rendering: dict[str, RenderingTally] = field(default_factory=dict)
    """How each drafter prompt rendering fared (`chat`)."""

    def clear(self) -> None:
        """Forget everything, as a freshly loaded pair knows nothing."""
        self.costs, self.schedule, self.learned_at, self.rendering = None, Learned(), None, {}
