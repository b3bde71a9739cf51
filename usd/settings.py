"""Every generation setting, checked once, here: the Python API, the CLI, `usd bench`, the UI and the server all
take their ranges, defaults and messages from this module."""

from __future__ import annotations

ALGORITHMS = ("auto", "tli", "slem", "standard", "none")
"""auto picks per round; tli and slem work across vocabularies; standard needs one tokenizer; none is the target
alone through the same loop."""
DRAFT_TOKENS_MAX = 16
MAX_NEW_TOKENS_MAX = 4096
DEFAULT_MAX_NEW_TOKENS = 256


def check_algorithm(algorithm) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return algorithm


def check_draft_tokens(k, allow_zero: bool = False) -> int | str:
    """'auto' or a whole number from 1 to DRAFT_TOKENS_MAX (0, plain decoding, only where the caller allows it: the
    decode loop does, users say algorithm none instead)."""
    if k == "auto":
        return k
    low = 0 if allow_zero else 1
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= DRAFT_TOKENS_MAX:
        hint = "" if allow_zero else " (to decode without a drafter, use algorithm none)"
        raise ValueError(f"draft tokens must be 'auto' or a whole number from {low} to {DRAFT_TOKENS_MAX}, got {k!r}"
                         f"{hint}")  # fmt: skip
    return k


def check_max_new_tokens(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS_MAX:
        raise ValueError(f"max new tokens must be a whole number from 1 to {MAX_NEW_TOKENS_MAX:,}, got {n!r}")
    return n
