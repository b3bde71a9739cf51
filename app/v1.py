"""The app's /v1 routes: the OpenAI-compatible server of `usd serve`, on the app's one loaded pair and sharing its
slots with the UI. A request may name the loaded target or another catalog model the app offers (in Space mode only
those the Space serves); another one is loaded as the target, with the loaded drafter, as the UI's API does."""

from __future__ import annotations

from usd.serve import APIError, Service

from .pairs import Pairs


class AppService(Service):
    def __init__(self, pairs: Pairs, **kwargs):
        super().__init__(**kwargs)
        self.pairs = pairs

    def models(self) -> list[dict]:
        loaded = self.pairs.loaded
        cards = [self.model_card(loaded.target, loaded.drafter, True)] if loaded else []
        return cards + [
            self.model_card(name, None, False) for name in self.pairs.allowed if not loaded or name != loaded.target
        ]

    def resolve(self, model: str) -> str:
        loaded = self.pairs.loaded
        if (loaded and model == loaded.target) or model in self.pairs.allowed:
            return model
        what = "this Space serves only" if self.pairs.space_mode else "this app serves"
        raise APIError(
            404,
            f"model {model!r} is not served here; {what} {', '.join(self.pairs.allowed)} (GET /v1/models lists them)",
            "model",
            "model_not_found",
        )

    def loaded(self, name: str):
        pair, loaded = self.pairs.pair, self.pairs.loaded
        return pair if loaded and loaded.target == name else None

    def pair(self, name: str):
        loaded = self.pairs.loaded
        if loaded and loaded.target == name:
            return self.pairs.current()
        drafter = loaded.drafter if loaded else self.pairs.catalog.default.drafter
        return self.pairs.load(name, drafter, log=lambda *_: None)
