"""An OpenAI-compatible server for the engine (`usd serve`, and the app's /v1): chat and text completions, plain or
streamed, with the engine's speculative stats (and, on request, every round's pieces) as an extension that standard
clients ignore. `protocol` is the wire format, `slots` the shared concurrency limit, `jobs` one request's generation,
`routes` the FastAPI routes."""

from .routes import create_app, create_router
from .service import FixedPair, Service
from .slots import QueueFull, Slots

__all__ = ["FixedPair", "QueueFull", "Service", "Slots", "create_app", "create_router"]
