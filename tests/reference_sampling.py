"""What the target's sampled answer must be distributed as, computed independently of the code under test: the
distribution after temperature, top-k and top-p written here in numpy (float64), not with `usd.sampling`, and the
exact joint distribution of an answer's first two tokens from the target's own next-token logits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def reference_p(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """softmax(logits / T) over the top-k logits (ties at the k-th kept), then over the smallest set of the most
    likely tokens whose mass reaches top-p (a token stays while the mass of those before it is below top-p)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if top_k and top_k < z.size:
        kth = np.sort(z)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p_sorted = _softmax(z[order])
        before = np.cumsum(p_sorted) - p_sorted
        keep = np.empty(z.size, dtype=bool)
        keep[order] = before < top_p
        z = np.where(keep, z, -np.inf)
    return _softmax(z)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def exact_joint(
    next_logits: Callable[[list[int]], np.ndarray], ids: list[int], eos: frozenset[int] = frozenset(), **settings
) -> dict[tuple[int, ...], float]:
    """P(an answer's first two tokens) for every answer the target can begin with, as the answers' target ids: (x, y);
    (x,) where y ends the answer and () where x does (an end of sequence is not part of an answer). `next_logits(ids)`
    is the target's logits for the position after `ids`; `settings` are reference_p's."""
    p1 = reference_p(next_logits(ids), **settings)
    joint: dict[tuple[int, ...], float] = {}
    for x in np.flatnonzero(p1).tolist():
        if x in eos:
            joint[()] = joint.get((), 0.0) + float(p1[x])
            continue
        p2 = reference_p(next_logits([*ids, x]), **settings)
        for y in np.flatnonzero(p2).tolist():
            cell = (x,) if y in eos else (x, y)
            joint[cell] = joint.get(cell, 0.0) + float(p1[x] * p2[y])
    return joint
