"""Hugging Face Space support: Space mode (the Space's own catalog models only, no local paths) and ZeroGPU's
decorator."""

from __future__ import annotations

import os

from usd.catalog import Catalog
from usd.store import local_path

SPACE_ENV = "USD_CHAT_SPACE"
"""1/true turns Space mode on, 0/false off; unset, it is on where Hugging Face sets SPACE_ID (inside a Space)."""
SPACE_MODELS_ENV = "USD_CHAT_SPACE_MODELS"
"""Comma-separated catalog names a Space serves besides its default pair; unset, the models already on disk."""


class SpaceModelsError(ValueError):
    """The deployer's list of served models names something the catalog lacks."""


def space_mode() -> bool:
    flag = os.environ.get(SPACE_ENV, "").strip().lower()
    if flag:
        return flag in ("1", "true", "yes", "on")
    return bool(os.environ.get("SPACE_ID"))


def space_models(catalog: Catalog) -> list[str]:
    """The catalog models a Space serves, in catalog order: its default pair (loaded at start), plus those listed in
    USD_CHAT_SPACE_MODELS or, without that list, those already on disk. A visitor who could name any catalog model
    could make the Space download tens of gigabytes, so the deployer decides what may be fetched."""
    listed = [name.strip() for name in os.environ.get(SPACE_MODELS_ENV, "").split(",") if name.strip()]
    for name in listed:
        if name not in catalog:
            raise SpaceModelsError(
                f"{SPACE_MODELS_ENV} names {name!r}, which is not in the catalog: list catalog "
                "names, separated by commas (`usd models` shows them)"
            )
    if not listed:
        listed = [entry.name for entry in catalog.models if local_path(entry) is not None]
    served = {catalog.default.target, catalog.default.drafter, *listed}
    return [name for name in catalog.names() if name in served]


def runs_elsewhere() -> bool:
    """Whether the handlers `gpu` wraps run in another process than the server's (ZeroGPU forks one per call)."""
    try:
        import spaces  # noqa: F401
    except ImportError:
        return False
    return True


def gpu(fn):
    """Run `fn` on a ZeroGPU slice when the `spaces` package is there (it is a no-op elsewhere); plain CUDA or the
    CPU otherwise."""
    if not runs_elsewhere():
        return fn
    import spaces

    return spaces.GPU(duration=120)(fn)
