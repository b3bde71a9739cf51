"""The /generate and /compare API endpoints' parameters: the prompt, the pair and each setting as its own named, typed
parameter, which gr.api reads from the endpoint's signature (a gradio_client caller names them:
`predict(prompt=..., temperature=0, api_name="/generate")`), handed to the handler gathered in one `Ask`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .handlers import DEFAULT, KNOBS

KNOB_TYPES: dict[str, object] = {
    "algorithm": str,
    "draft_tokens": str,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int | None,
    "max_new_tokens": int,
}
"""What an API caller sends for each setting (KNOBS), as its schema shows it."""


@dataclass(frozen=True)
class Ask:
    """One API call's arguments, as sent: the handler checks them (`Handlers.checked`)."""

    prompt: object
    target: str
    drafter: str
    knobs: tuple
    """The settings' values, in KNOBS' order."""


def _parameter(name: str, annotation, default=inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


PARAMETERS = (
    _parameter("prompt", str),
    _parameter("target", str, ""),
    _parameter("drafter", str, ""),
    *(_parameter(name, KNOB_TYPES[name], getattr(DEFAULT, name)) for name in KNOBS),
)
"""The endpoints' parameters in the order Gradio passes them; empty target and drafter: the loaded pair."""


def endpoint(handler: Callable[[Ask], Iterator]) -> Callable[..., Iterator]:
    """`handler` as an API endpoint taking PARAMETERS; its name, docstring and return type stay the handler's."""
    signature = inspect.Signature(PARAMETERS, return_annotation=handler.__annotations__.get("return"))

    @functools.wraps(handler)
    def call(*values) -> Iterator:
        given = signature.bind(*values)
        given.apply_defaults()
        a = given.arguments
        yield from handler(Ask(a["prompt"], a["target"], a["drafter"], tuple(a[name] for name in KNOBS)))

    call.__signature__ = signature  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in PARAMETERS} | {"return": signature.return_annotation}
    return call
