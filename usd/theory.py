"""Expected speedup of speculative decoding (Leviathan et al. 2023), in the notation of docs/design.md, section 2."""

from __future__ import annotations


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """tau: with i.i.d. acceptance alpha, a round emits (1 - alpha^(k+1)) / (1 - alpha) tokens."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0, o: float = 0.0) -> float:
    """S = tau / (k c + v + o): tokens per round over the round's cost in target single-step units."""
    return expected_tokens_per_round(alpha, k) / (k * c + v + o)
