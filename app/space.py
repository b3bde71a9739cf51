"""Hugging Face Space support: Space mode (catalog models only, no local paths) and ZeroGPU's decorator."""

from __future__ import annotations

import os

SPACE_ENV = "USD_CHAT_SPACE"
"""1/true turns Space mode on, 0/false off; unset, it is on where Hugging Face sets SPACE_ID (inside a Space)."""


def space_mode() -> bool:
    flag = os.environ.get(SPACE_ENV, "").strip().lower()
    if flag:
        return flag in ("1", "true", "yes", "on")
    return bool(os.environ.get("SPACE_ID"))


def gpu(fn):
    """Run `fn` on a ZeroGPU slice when the `spaces` package is there (it is a no-op elsewhere); plain CUDA or the
    CPU otherwise."""
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=120)(fn)
