"""Which algorithm and draft length each round uses, learned from the rounds so far (DESIGN.md section 3).

A fixed algorithm keeps its algorithm; with `draft_tokens="auto"` its k still adapts. `auto` measures instead of
guessing: every mode it may use (plain decoding, and standard, or tli and slem) keeps a running cost in seconds per
emitted token, the cheapest mode wins, and the others are probed now and then so a change (a code block where the
drafter shines, a paragraph where it does not) is noticed. Measured cost already holds alpha, c, v and the loop's
own overhead, so auto falls back to plain decoding exactly when speculation loses on this machine. The costs live
in `pair.memory` and carry over to the next generation of the pair; the draft length adapts within a generation.
Under sampling with a seed, auto picks between plain decoding and slem only: the seed fixes their answer whatever
the schedule does (see `sampling.position_generator`), while tli's rejection sampling draws depend on where rounds
were cut.

Choosing a mode or a length from past rounds only (never from the token about to be verified) keeps the output
lossless: every round emits tokens distributed as the target's, whatever it was told to do.
"""

from __future__ import annotations

K_START = 4
K_MAX = 8
MIN_TRIES = 3
"""Rounds a mode gets before it can be judged."""
PROBE_EVERY = 16
"""A mode that is not the cheapest is still tried after this many rounds; each probe that finds it still losing
doubles its wait (up to PROBE_MAX), so a pair where speculation never pays costs almost nothing to keep watching."""
PROBE_MAX = 256
DECAY = 0.85
"""Weight of the past in the running cost: about the last seven rounds count."""
MIN_CONFIDENCE = 0.25
"""With adaptive k, stop a draft when the drafter's own top probability falls below this."""


class Schedule:
    def __init__(self, pair, algorithm: str, k: int | str, probe_first: bool = True, seeded_sampling: bool = False):
        self.algorithm = algorithm
        if algorithm != "auto":
            self.modes = [algorithm]
        elif seeded_sampling:
            self.modes = ["none", "slem"]  # the seed fixes their answer, however rounds are cut (see decoder)
        else:
            self.modes = ["none", "standard"] if pair.same_tokenizer else ["none", "tli", "slem"]
        self.adaptive_k = k == "auto"
        self.k_fixed = None if self.adaptive_k else int(k)
        self.min_confidence = MIN_CONFIDENCE if self.adaptive_k else 0.0
        self.probe_first = probe_first
        self.round = 0
        memory = pair.memory.setdefault("schedule", {})
        self.cost = memory.setdefault("cost", {})  # mode -> [decayed seconds, decayed tokens, rounds]
        # mode -> draft length that is paying off; per generation, so a seeded sample does not depend on the last one
        self.k: dict[str, int] = {}
        self.gap = memory.setdefault("gap", {})  # mode -> rounds to wait before probing it again
        # rounds since each mode last ran, counted across generations: a probe costs a drafter prefill and catch-up,
        # so restarting the count per generation would probe in every answer
        self.since = memory.setdefault("since", {})
        for m in self.modes:
            self.since.setdefault(m, 0)

    def per_token(self, mode: str) -> float:
        s, t, _ = self.cost.get(mode, (0.0, 0.0, 0))
        return s / t if t else float("inf")

    def next(self) -> tuple[str, int]:
        """(algorithm, k) for the coming round; ("none", 0) is a plain target step."""
        if self.round == 0 and self.probe_first:
            return "none", 0
        mode = self.modes[0] if len(self.modes) == 1 else self._choose()
        if mode == "none":
            return mode, 0
        return mode, self.k_fixed if self.k_fixed is not None else self.k.get(mode, K_START)

    def _choose(self) -> str:
        untried = [m for m in self.modes if self.cost.get(m, (0, 0, 0))[2] < MIN_TRIES]
        if untried:
            return min(untried, key=lambda m: self.cost.get(m, (0, 0, 0))[2])
        best = min(self.modes, key=self.per_token)
        overdue = [m for m in self.modes if m != best and self.since[m] >= self.gap.get(m, PROBE_EVERY)]
        return max(overdue, key=lambda m: self.since[m]) if overdue else best

    def observe(self, mode: str, k: int, drafted: int, accepted: int, emitted: int, seconds: float) -> None:
        self.round += 1
        for m in self.modes:
            self.since[m] = 0 if m == mode else self.since[m] + 1
        s, t, n = self.cost.get(mode, (0.0, 0.0, 0))
        self.cost[mode] = [DECAY * s + seconds, DECAY * t + emitted, n + 1]
        if len(self.modes) > 1 and n + 1 >= MIN_TRIES:
            best = min(self.modes, key=self.per_token)
            self.gap[mode] = PROBE_EVERY if mode == best else min(PROBE_MAX, 2 * self.gap.get(mode, PROBE_EVERY // 2))
        if self.adaptive_k and mode != "none" and k > 0:
            if drafted and accepted == drafted:
                self.k[mode] = min(K_MAX, k + 1)
            elif accepted == 0:
                self.k[mode] = max(1, k - 1)
