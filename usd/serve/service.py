"""What the routes serve (`Service`): the models a request may name, the pair to run each on, the shared slots and
the key; `FixedPair` is usd serve's. The routes (routes.py) and each request's job (jobs.py) both read it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from usd import suffix
from usd.pair import Pair

from . import protocol as p
from .slots import Slots


class Service:
    """What the routes serve: the models a request may name, the pair to run each on, the shared slots, the key.
    `wrap` wraps the function that runs the models (the app passes ZeroGPU's decorator)."""

    def __init__(self, slots: Slots | None = None, api_key: str | None = None, wrap: Callable = lambda fn: fn):
        self.slots = slots or Slots()
        self.api_key = api_key or None
        self.wrap = wrap
        self.started = int(time.time())

    @property
    def memory_scope(self) -> str | None:
        """Whose earlier answers a request's suffix drafts come from, and where its answer is remembered: on a keyed
        server the key's (by a digest: the key itself is kept nowhere else), on an unkeyed one the local scope."""
        if self.api_key is None:
            return suffix.LOCAL
        return "key:" + hashlib.sha256(self.api_key.encode()).hexdigest()[:16]

    def models(self) -> list[dict]:
        raise NotImplementedError

    def resolve(self, model: str) -> str:
        """The served name `model` means; APIError 404 when it names nothing served here."""
        raise NotImplementedError

    def loaded(self, name: str) -> Pair | None:
        """The pair for `name` if it is loaded now (its prompt can be checked before the request queues)."""
        raise NotImplementedError

    def pair(self, name: str) -> Pair:
        """The pair for `name`, loading it if needed; called holding a slot."""
        raise NotImplementedError

    def model_card(self, name: str, drafter: str | None, loaded: bool) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "usd-chat",
            "drafter": drafter,
            "loaded": loaded,
        }


class FixedPair(Service):
    """`usd serve`: one pair, loaded once; a request names its target."""

    def __init__(self, pair: Pair, **kwargs):
        super().__init__(**kwargs)
        self._pair = pair

    def models(self) -> list[dict]:
        return [self.model_card(self._pair.target_name, self._pair.drafter_name, True)]

    def resolve(self, model: str) -> str:
        if model != self._pair.target_name:
            raise p.APIError(
                404,
                f"model {model!r} is not served here; this server serves "
                f"{self._pair.target_name!r} (GET /v1/models lists it)",
                "model",
                "model_not_found",
            )
        return model

    def loaded(self, name: str) -> Pair:
        return self._pair

    def pair(self, name: str) -> Pair:
        return self._pair
