"""The runners a model can load on, in one table: which precisions each serves, which form of the weights it reads,
the device it is bound to, whether it is installed, and the functions that size and load a model on it. The loader,
the CLI, the bench and the app ask this table (`backend_of`) instead of naming a precision; a new runner is a row here
and its package under usd/runners/ (docs/design.md §7)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InternalError


@dataclass(frozen=True)
class Backend:
    name: str
    """The runner's name in messages ("llama.cpp")."""
    library: str
    """What must be installed for it, in messages ("llama-cpp-python")."""
    precisions: tuple[str, ...]
    note: str
    """What loading on it means, for the load line; empty where the loader says it per precision (transformers)."""
    converted: bool
    """It reads a transformers model from float safetensors (converted once from the GGUF where the store holds a
    GGUF model), which transformers' own generate (the bench's `hf` anchor) can drive too; else the GGUF as it is."""
    device: str | None
    """The one device it runs on, or None: the device asked for."""
    package: str
    """Its package, imported only when asked whether it is installed."""
    estimate: str
    """"module:function" (entry, precision, device, config) -> bytes: the memory a load takes."""
    load: str
    """"module:function" (entry, path, plan, tokenizer, log) -> LoadedModel."""
    on_torch: bool
    """Its forwards compute on torch, whose thread count follows the models loaded (runners/torch_threads.py)."""

    def available(self) -> bool:
        """Whether its library is installed (the package's `available()`; a package without one always is)."""
        check = getattr(importlib.import_module(self.package), "available", None)
        return check() if check is not None else True

    @property
    def install_hint(self) -> str:
        return getattr(importlib.import_module(self.package), "INSTALL_HINT", "")

    def estimate_bytes(self, *args: Any) -> int:
        return _resolve(self.estimate)(*args)

    def load_model(self, *args: Any):
        return _resolve(self.load)(*args)


def _resolve(ref: str) -> Callable:
    module, function = ref.split(":")
    return getattr(importlib.import_module(module), function)


LLAMACPP = Backend(
    name="llama.cpp",
    library="llama-cpp-python",
    precisions=("gguf",),
    note="the GGUF's own quantized weights on llama.cpp (CPU), not converted.",
    converted=False,
    device="cpu",
    package="usd.runners.llamacpp",
    estimate="usd.loading:gguf_bytes",
    load="usd.loading:load_gguf",
    on_torch=False,
)
TRANSFORMERS = Backend(
    name="transformers",
    library="transformers",
    precisions=("nf4", "int8", "bf16", "fp16", "fp32"),
    note="",
    converted=True,
    device=None,
    package="usd.runners.transformers",
    estimate="usd.loading:torch_bytes",
    load="usd.loading:load_transformers",
    on_torch=True,
)
BACKENDS = (LLAMACPP, TRANSFORMERS)


def backend_of(precision: str) -> Backend:
    """The runner a precision loads on. An unknown precision is a bug here: settings and the catalog check it first."""
    for backend in BACKENDS:
        if precision in backend.precisions:
            return backend
    raise InternalError(f"no runner serves precision {precision!r}")
