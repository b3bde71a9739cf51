"""usd: universal speculative decoding, lossless across vocabularies.

`load_pair`, `stream` and `generate` are the API, `GenerationSettings` how to generate; `Round`, `Piece`, `Finished`
and `Stats` are what streams yield. They are imported on first use, so `usd models` and friends start without loading
torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_pair": "api",
    "stream": "api",
    "generate": "api",
    "Pair": "pair",
    "PromptError": "chat",
    "LoadError": "loading",
    "GenerationSettings": "settings",
    "Round": "events",
    "Piece": "events",
    "Finished": "events",
    "Stats": "events",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'usd' has no attribute {name!r}")
