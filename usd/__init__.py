"""usd: universal speculative decoding, lossless across vocabularies.

`load_pair`, `stream` and `generate` are the API, `GenerationSettings` how to generate; `Round`, `Piece`, `Finished`
and `Stats` are what streams yield. They are imported on first use, so `usd models` and friends start without loading
torch.
"""

from __future__ import annotations

from .lazy import exports

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

__getattr__ = exports(__name__, _EXPORTS)
