"""The transformers runner: a model and the kind of decoding steps its contexts take."""

from __future__ import annotations

import torch

from .context import Context
from .static_cache import KINDS, CachePool, CompiledStep, StaticContext


class TransformersRunner:
    """Opens a transformers model's decoding contexts on one kind of decoding steps (static_cache.py): transformers'
    own cache ("dynamic"), a static cache from the runner's pool, or one with the one-token step compiled. What a
    kind needs (the pool, the compiled step) is made once, with the runner."""

    def __init__(self, model, steps: str = "dynamic"):
        if steps not in KINDS:
            raise ValueError(f"unknown step kind {steps!r}; one of {', '.join(KINDS)}")
        self.model, self.steps = model, steps
        self.pool = CachePool(model.config) if steps != "dynamic" else None
        self.compiled = None
        if steps == "compiled":
            self.compiled = CompiledStep(model, "reduce-overhead" if model.device.type == "cuda" else "default")

    def new_context(self, ids: list[int]) -> Context:
        if self.pool is None:
            return Context(self.model, ids)
        return StaticContext(self.model, ids, self.pool, self.compiled)

    def forget(self) -> None:
        """Nothing to drop: every context starts from an empty cache (the pool's are reset when handed out)."""

    def cpu_threads(self) -> int | None:
        return torch.get_num_threads() if self.model.device.type == "cpu" else None
