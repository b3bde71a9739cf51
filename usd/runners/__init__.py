"""How a model's forwards run. Each loaded model comes with a runner, which opens decoding contexts for it: the
transformers runner (`runners.transformers`: PyTorch with a KV cache per context) or the llama.cpp runner
(`runners.llamacpp`: a GGUF as it is, on batch-invariant kernels). The decode loop sees only the two protocols here;
target and drafter may run on different runners (docs/design.md §7)."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch


class DecodingContext(Protocol):
    """One model's token ids and its cache over them, as the decode loop drives it. The caller appends ids to `ids`
    and calls `forward`; `truncate` rolls back. Every evaluation of a position gives the same logits, whatever was
    fed before or batched with it, as far as the runner can promise (docs/design.md §8)."""

    ids: list[int]
    cached: int
    """How many of `ids` the cache holds (the rest the next forward feeds)."""
    forward_s: float
    """Seconds spent inside model forwards (the rest of a round's time is the loop's own)."""

    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` ids (0: all the new ones) as [n, V]
        float32 on the CPU. The first row asked for may be the last position fed before, whose logits the context
        keeps (`kept.KeptLogits`): asking for one more row than is new costs nothing more."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first n ids (the cache follows)."""
        ...


@runtime_checkable
class Runner(Protocol):
    def new_context(self, ids: list[int]) -> DecodingContext: ...

    def forget(self) -> None:
        """Drop what the runner keeps between contexts (llama.cpp's cached sequences, which a later prompt could
        reuse): a measurement leaves nothing behind for a prompt to meet."""
        ...

    def cpu_threads(self) -> int | None:
        """The threads its forwards compute on, on this machine's CPU; None where they run elsewhere (a GPU)."""
        ...


def cpu_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


class OwnRunner:
    """A model that opens its own decoding contexts (the llama.cpp runner's `LlamaCppModel`): it declares itself so
    by inheriting this, and implements `Runner` itself. Known by its class, so that no model is probed for
    attributes (a stand-in that fails on any attribute stays untouched)."""

    def new_context(self, ids: list[int]) -> DecodingContext:
        raise NotImplementedError

    def forget(self) -> None:
        raise NotImplementedError

    def cpu_threads(self) -> int | None:
        raise NotImplementedError


def is_own_runner(model) -> bool:
    """Whether the model is its own runner (`OwnRunner`)."""
    return isinstance(model, OwnRunner)


def runner_for(model) -> Runner:
    """The runner of a model given without one (tests, scripts, a Pair built by hand): a model that is its own runner
    (the llama.cpp runner's `LlamaCppModel`), else transformers' own decoding steps."""
    if is_own_runner(model):
        return model
    from .transformers import TransformersRunner

    return TransformersRunner(model)
