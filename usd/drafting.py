"""The seam between the decode loop and what drafts: one protocol, `Source`, that every drafting source takes (the
drafter model's tli, slem and standard, the n-gram lookup, the suffix memory), and what a source starts on, `Start`.

A source is made per answer by the factory its row of the algorithms table names (`algorithms.Spec.source`). The loop
asks it, each round, whether it can propose now, for up to k candidates, and tells it what the round committed; it
never asks what kind of source it holds. A source's proposal may depend on anything but the target's coming tokens:
each round's output is then distributed as the target's, whatever was proposed (docs/design.md §5).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .sampling import SamplingParams, position_generator

if TYPE_CHECKING:
    from .algorithms import Algorithm
    from .pair import Pair


@dataclass
class Draft:
    candidates: list[int] = field(default_factory=list)
    """Proposed target ids."""
    q: list[torch.Tensor] = field(default_factory=list)
    """Per candidate, the distribution it was drawn from over target ids (empty when greedy, and for the sources whose
    proposal is deterministic, q one-hot: exact match verifies those)."""
    drafter_ids: list[tuple[int, ...]] = field(default_factory=list)
    """Per candidate, the drafter ids behind it (empty for SLEM, whose candidates come from re-tokenized text)."""
    steps: int = 0
    """Drafter forwards spent."""
    copied_from: int | None = None
    """A draft copied from the context: the position its first candidate was copied from (the others follow it)."""

    def fitted(self, room: int) -> Draft:
        """At most `room` candidates: slem's re-tokenized text can hold more target tokens than the drafter wrote,
        and the target must not be fed past its context."""
        if len(self.candidates) <= room:
            return self
        return Draft(self.candidates[:room], self.q[:room], self.drafter_ids[:room], self.steps, self.copied_from)


def cut_after_eos(candidates: list[int], eos: set[int]) -> list[int]:
    """A draft ends at an end of sequence: nothing is drafted past the end of the answer."""
    end = next((i + 1 for i, t in enumerate(candidates) if t in eos), len(candidates))
    return candidates[:end]


@dataclass(frozen=True)
class Randomness:
    """Where a round's random draws come from (sampling.make_generator): the drafter's samples and rejection
    sampling's uniforms from one stream, the target's own draw at each answer position from that position's."""

    drafter: np.random.Generator
    base_seed: int

    def at_positions(self, first: int, n: int) -> list:
        return [position_generator(self.base_seed, first + i) for i in range(n)]


@dataclass(frozen=True)
class Rules:
    """What stays the same over a generation's rounds: the pair, the sampling settings and where the random draws
    come from, the ids that end the answer, and the drafter's confidence stop (0: none)."""

    pair: Pair
    params: SamplingParams
    rng: Randomness
    eos: set[int]
    min_confidence: float


@dataclass
class Start:
    """What a source starts on: the answer's rules, the prompt in the target's ids (and the drafter's, where its
    tokenizer differs), the committed answer as it grows (`decoder.Answer`: its target ids and bytes), where the
    answers of this process are remembered for it (`suffix.Scope`, or None), and what the sources of one answer share
    (the drafter model's state, `drafters.DrafterState`, made at the first model source's start)."""

    rules: Rules
    prompt_ids: list[int]
    drafter_prompt_ids: list[int] | None
    answer: Any
    memory: Any = None
    shared: dict = field(default_factory=dict)
    """What sources of one answer share, by its type."""
    accounts: list[Account] = field(default_factory=list)
    """What the sources run that the answer's numbers count, each once (a drafter model's forwards and catching up)."""


class Account(Protocol):
    """A model a source runs: its forward time, its catching up not yet charged to a round, and why it stopped."""

    stopped: str | None

    @property
    def forward_s(self) -> float: ...

    def bill(self) -> tuple[float, int]:
        """Seconds and positions of catching up no round was charged for yet, now charged to one."""
        ...


class Source(Protocol):
    """One way of drafting, behind the loop's one seam."""

    def available(self) -> bool:
        """Whether it can propose now, cheaply told (a lookup that finds nothing to continue, a drafter whose context
        is full: no): the schedule weighs only the sources that can."""
        ...

    def room(self) -> int:
        """How many candidates it may propose in the round it was chosen for (a drafter model catches up first)."""
        ...

    def pending(self) -> int:
        """Positions it would feed before its first draft step (a drafter model catching up); 0 for the others."""
        ...

    def propose(self, k: int) -> Draft:
        """Up to k candidates, each with its proposal distribution q (none where q is one-hot)."""
        ...

    def commit(self, emitted: list[int]) -> None:
        """What the round committed to the answer (accepted candidates and the target's token), whoever drafted."""
        ...


def start_source(algorithm: Algorithm, start: Start) -> Source:
    """A new source of the algorithm's drafts for one answer: the factory its row of the table names."""
    assert algorithm.spec.source is not None, f"{algorithm.value} drafts nothing itself"
    module, name = algorithm.spec.source.split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)(start)
