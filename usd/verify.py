"""Acceptance rules, on tensors only. Names follow the paper: p is the target's distribution, q the drafter's
proposal distribution (over target ids), drafted the candidate target ids.

Each rule returns (accepted, next_token, next_kind): how many leading candidates are kept, and the one token the
target adds after them, `resampled` at the first rejection or `bonus` after a fully accepted draft.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import InternalError
from .sampling import sample, uniform


def rejection_sampling(
    p: torch.Tensor, q: torch.Tensor, drafted: list[int], generator: np.random.Generator
) -> tuple[int, int, str]:
    """Speculative sampling (Leviathan et al., Chen et al.): lossless for any proposal q.

    p: [k+1, V] target distributions at each candidate position and one past the last.
    q: [k, V] the distributions the candidates were sampled from, over the same ids (zero where the drafter cannot go).
    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection resample from
    normalize(max(0, p_i - q_i)); after k acceptances add a bonus token from p_{k+1}.
    """
    k = len(drafted)
    for i, d in enumerate(drafted):
        p_d, q_d = float(p[i, d]), float(q[i, d])
        if q_d <= 0.0:
            raise InternalError(f"candidate {i} (id {d}) has q = 0: it cannot have been sampled from q")
        if uniform(generator) < min(1.0, p_d / q_d):
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        # p <= q everywhere only when p == q (both sum to 1), and then rejection has probability 0; guard rounding.
        resampled = sample(residual / total if total > 0 else p[i], generator)
        return i, resampled, "resampled"
    return k, sample(p[k], generator), "bonus"


def exact_match(p: torch.Tensor, drafted: list[int], generators: list[np.random.Generator]) -> tuple[int, int, str]:
    """String-level exact match (SLEM), also under sampling: at each position the target draws its own token from
    p_i (with generators[i], one per position); the candidate survives only if it is that very token. Every emitted
    token is a draw from p, so this is lossless whatever produced the candidates (which need no q at all)."""
    for i, d in enumerate(drafted):
        own = sample(p[i], generators[i])
        if own != d:
            return i, own, "resampled"
    return len(drafted), sample(p[len(drafted)], generators[len(drafted)]), "bonus"


def greedy_match(target_argmax: list[int], drafted: list[int]) -> tuple[int, int, str]:
    """Greedy: keep candidates while they equal the target's argmax; then emit the target's argmax."""
    for i, d in enumerate(drafted):
        if target_argmax[i] != d:
            return i, target_argmax[i], "resampled"
    return len(drafted), target_argmax[len(drafted)], "bonus"
