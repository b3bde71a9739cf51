"""The logits a decoding context keeps of the last position it fed, shared by both runners' contexts."""

from __future__ import annotations

import torch


class KeptLogits:
    """The logits of the last position a context fed, while its ids up to there stand. The loop reads a prompt's last
    position twice: when the prompt is fed (in one forward, as plain tools read it, so the first token is chosen on the
    same bits as theirs) and as the first row of round 0's verify. Keeping the row spares feeding that position again,
    which on the llama.cpp runner would mean feeding its whole prompt batch again (docs/design.md §8)."""

    def __init__(self):
        self.position = -1
        self.row: torch.Tensor | None = None

    def take(self, n_ids: int, n_out: int) -> tuple[torch.Tensor | None, int]:
        """For a forward asked for the logits of the last `n_out` of `n_ids` ids: the kept row if it is the first of
        them, and how many rows are left to compute."""
        held = self.row if n_out > 0 and self.position == n_ids - n_out else None
        return held, n_out - (held is not None)

    def joined(self, held: torch.Tensor | None, fresh: torch.Tensor | None, n_ids: int) -> torch.Tensor:
        """A forward's rows: the `held` row (if any), then the `fresh` ones computed, whose last is kept from now on."""
        if fresh is None:
            assert held is not None  # a forward that computed nothing served the kept row
            return held[None]
        if len(fresh):
            self.position, self.row = n_ids - 1, fresh[-1].clone()  # a copy: callers may change what they got
        return torch.cat([held[None], fresh]) if held is not None else fresh

    def drop_from(self, n: int) -> None:
        """The ids from n on are gone (a rollback): a kept row there no longer holds."""
        if self.position >= n:
            self.position, self.row = -1, None
