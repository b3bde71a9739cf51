"""An OpenAI-compatible server for the engine (`usd serve`, and the app's /v1): chat and text completions, plain or
streamed, with the engine's speculative stats (and, on request, every round's pieces) as an extension that standard
clients ignore. `protocol` is the wire format, `slots` the shared concurrency limit, `jobs` one request's generation,
`routes` the FastAPI routes.

The names below are the package's API (the app mounts the server's routes in its own and shares its slots); they are
imported on first use, so that importing one submodule does not import the others through this package."""

from __future__ import annotations

from ..lazy import exports

_EXPORTS = {
    "API_KEY_ENV": "main",
    "APIError": "protocol",
    "BodyLimit": "limits",
    "FixedPair": "service",
    "QueueFull": "slots",
    "Service": "service",
    "Slots": "slots",
    "add_memory_argument": "main",
    "create_app": "routes",
    "create_router": "routes",
    "stats_from_speculative": "protocol",
}
__all__ = sorted(_EXPORTS)

__getattr__ = exports(__name__, _EXPORTS)
