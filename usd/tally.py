"""The running counts of one generation. Every Round and the Finished event carry `Tally.stats()`, so what the live
panel shows during a generation is computed exactly as the final numbers are."""

from __future__ import annotations

import time

from .events import Stats
from .record import RoundRecord


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


MIN_PLAIN_STEPS = 4
"""Plain steps measured before they are the unit of c and v (an answer's, here; auto's cost model's, in schedule.py);
until then the step timed at load is. An answer that drafts in almost every round has one or two plain steps, and
one slowed by other work (the browser drawing the page the answer starts in) made its verify look cheaper than a step
and its loss a gain."""


def reference_step(steps: list[float], typical, at_load: float | None) -> float | None:
    """The target's step that c and v are measured in: `typical` (mean or median) of the steps measured, or the step
    timed at load while fewer than MIN_PLAIN_STEPS are."""
    if len(steps) < MIN_PLAIN_STEPS and at_load:
        return at_load
    return typical(steps)


class Tally:
    def __init__(self, algorithm: str, step_at_load: float | None = None):
        self.algorithm = algorithm
        self.step_at_load = step_at_load
        """The target's step timed at load (usd/costs.py): the unit while the answer has fewer than MIN_PLAIN_STEPS."""
        self.started = time.perf_counter()
        self.rounds = self.drafted = self.accepted = self.drafting_rounds = 0
        self.by_algorithm: dict[str, int] = {}
        self.drafted_by: dict[str, int] = {}
        self.accepted_by: dict[str, int] = {}
        self.step_s: list[float] = []
        """Plain target steps: the unit of c and v."""
        self.verify_s: list[float] = []
        self.draft_step_s: list[float] = []
        self.prompt_s = 0.0
        """The target's forward over the prompt (set by the decode loop)."""

    def record(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.drafting_rounds += r.drafted > 0
        name = r.algorithm.value
        self.by_algorithm[name] = self.by_algorithm.get(name, 0) + 1
        if r.drafted:
            self.drafted_by[name] = self.drafted_by.get(name, 0) + r.drafted
            self.accepted_by[name] = self.accepted_by.get(name, 0) + r.accepted
        if r.full_forward:
            (self.verify_s if r.drafted else self.step_s).append(r.verify_s)
        if r.draft_steps:
            self.draft_step_s.append(r.draft_s / r.draft_steps)

    def stats(self, tokens: int, stop_reason: str | None, forward_s: float, drafting_stopped: str | None) -> Stats:
        step = reference_step(self.step_s, _mean, self.step_at_load)
        draft_step, verify = _mean(self.draft_step_s), _mean(self.verify_s)
        c = draft_step / step if step and draft_step is not None else None
        v = verify / step if step and verify is not None else None
        return Stats(
            algorithm=self.algorithm,
            rounds=self.rounds,
            drafted=self.drafted,
            accepted=self.accepted,
            tokens=tokens,
            wall_s=time.perf_counter() - self.started,
            stop_reason=stop_reason,
            c=c,
            v=v,
            mean_k=self.drafted / self.drafting_rounds if self.drafting_rounds else 0.0,
            rounds_by_algorithm=dict(self.by_algorithm),
            drafted_by_algorithm=dict(self.drafted_by),
            accepted_by_algorithm=dict(self.accepted_by),
            forward_s=forward_s,
            drafting_stopped=drafting_stopped,
            step_s=step,
            prompt_s=self.prompt_s,
        )
