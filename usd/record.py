"""A round's record: what one round did and what it cost, built once by the decode loop (`decoder.Generation.step`)
and read, as it is, by the tally, auto's schedule and cost model, and the `Round` event."""

from __future__ import annotations

from dataclasses import dataclass

from .algorithms import Algorithm


@dataclass(frozen=True)
class RoundRecord:
    algorithm: Algorithm
    k: int
    """The draft length the round was planned with (what the drafter may have stopped short of)."""
    drafted: int
    accepted: int
    draft_steps: int = 0
    """The drafter's forwards (slem's may differ from the candidates it gave)."""
    draft_s: float = 0.0
    verify_s: float = 0.0
    """The target's forward over the candidates and the token before them."""
    round_s: float | None = None
    """The whole round, the loop's own work included (None: drafting and verifying only)."""
    fed: int | None = None
    """Positions the target's forward fed: drafted + 1 (None), but in round 0 only the drafts (the prompt's last
    position came with the prompt). Only a forward over drafted + 1 positions is a step or a verify of its k."""
    setup_s: float = 0.0
    """What the round's algorithm cost before it and outside it (a drafter's prefill, or its catching up on what was
    committed while it did not draft): not a cost of its rounds, but part of what trying it cost."""
    setup_tokens: int = 0
    """The drafter positions that setup fed."""
    context: int = 0
    """The target's cache length when the round began: forwards cost more over a longer cache."""

    def __post_init__(self):
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))  # a name given: its member (or a bug)

    @property
    def emitted(self) -> int:
        """Tokens the round emitted: the accepted candidates and the target's own token."""
        return self.accepted + 1

    @property
    def positions_fed(self) -> int:
        return self.drafted + 1 if self.fed is None else self.fed

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s if self.round_s is None else self.round_s

    @property
    def other_s(self) -> float:
        """The loop's own share of the round."""
        return max(0.0, self.seconds - self.draft_s - self.verify_s)

    @property
    def full_forward(self) -> bool:
        """Whether its forward fed what its kind feeds (a plain step one position, a verify of k its k + 1)."""
        return self.positions_fed == self.drafted + 1
