"""Expected speedup of speculative decoding (Leviathan et al. 2023), in the notation of docs/design.md, section 2."""

from __future__ import annotations

from collections.abc import Callable


def tau(alpha: float, k: int) -> float:
    """Expected tokens a round emits with k drafted at i.i.d. acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0, o: float = 0.0) -> float:
    """S = tau / (k c + v + o): tokens per round over the round's cost in target single-step units."""
    return tau(alpha, k) / (k * c + v + o)


def best_k(alpha: float, c: float, v: Callable[[int], float], ks) -> tuple[int, float]:
    """The draft length among `ks` of the highest expected speedup tau(alpha, k) / (k c + v(k)), and that speedup
    (the shorter draft on a tie)."""
    speedups = [(expected_speedup(alpha, k, c, v(k)), k) for k in ks]
    s, k = max(speedups, key=lambda sk: (sk[0], -sk[1]))
    return k, s
