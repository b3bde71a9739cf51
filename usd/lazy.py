"""A package's names imported on first use (PEP 562): `usd` and `usd.serve` name their API without importing the
modules behind it, so that `usd models` starts without torch, and importing one submodule of `usd.serve` does not
import the others through the package."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, modules: dict[str, str]) -> Callable[[str], object]:
    """The package's module `__getattr__`: each name in `modules` from the submodule named beside it."""

    def getattr_(name: str):
        if name in modules:
            return getattr(importlib.import_module(f".{modules[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
