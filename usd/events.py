"""What the decode loop yields: one `Round` per target forward, then one `Finished`. Frozen, UI-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from .algorithms import PLAIN

if TYPE_CHECKING:
    from .record import RoundRecord

KINDS = ("accepted", "rejected", "resampled", "bonus", "target")


@dataclass(frozen=True)
class Piece:
    text: str
    kind: str
    """accepted (drafted and kept), rejected (drafted, thrown away), resampled, bonus, or target (plain decoding)."""
    target_id: int | None
    round: int
    drafter_ids: tuple[int, ...] = ()
    source: str = ""
    """What drafted it (the algorithm: "ngram" for the lookup, else the drafter model's tli, slem or standard); empty
    for the target's own tokens."""
    copied_from: int | None = None
    """An ngram piece's origin: the position in the target's ids (prompt and answer) it was copied from."""

    def as_dict(self) -> dict:
        """The wire form of a piece (the server's `pieces`, the app's API), which `from_dict` reads back."""
        return {
            "text": self.text,
            "kind": self.kind,
            "round": self.round,
            "target_id": self.target_id,
            "drafter_ids": list(self.drafter_ids),
            "source": self.source,
            "copied_from": self.copied_from,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Piece:
        ids = tuple(d.get("drafter_ids") or ())
        return cls(
            d["text"], d["kind"], d.get("target_id"), d["round"], ids, d.get("source") or "", d.get("copied_from")
        )


@dataclass(frozen=True)
class Bound:
    """The most speculation can gain over plain decoding on this machine, from the drafter's step and the target's
    verify cost measured at load: (k + 1) / (k c + v(k)) with every drafted token accepted, at the best k
    (`schedule.speedup_bound`). Below 1, no draft length pays whatever the acceptance."""

    k: int
    speedup: float
    c: float
    """The drafter's step over the target's."""
    v: float
    """The target's forward over k + 1 positions over its step, v(k)."""
    measured: str = "at load"
    """Where c and v come from: "at load" (usd/costs.py), or "while decoding" (earlier answers' rounds)."""


class SourceState(StrEnum):
    """Where one of auto's sources stands after a round: running, or why it is off."""

    IN_USE = "in use"
    CANNOT_PAY = "cannot pay"
    """Even with every drafted token accepted it would be slower than plain decoding here (`Bound`)."""
    DROPPED = "dropped"
    """Its rounds in this answer were slower than plain decoding: not run again in it."""
    NO_MATCH = "no match"
    """A lookup that finds no continuation of the text now."""
    BUDGET = "budget spent"
    """Trying it might lose more than the answer's probing budget has left (schedule.PROBE_SHARE)."""
    UNTRIED = "untried"
    LOSES = "loses"
    """Expected slower than plain decoding; tried now and then in case that changes."""
    SLOWER = "slower"
    """Expected to gain, but less than the source in use."""


@dataclass(frozen=True)
class Source:
    """One of auto's sources (an algorithm) as it stands after a round, for the panel."""

    name: str
    state: SourceState
    speedup: float | None = None
    """Its speed over plain decoding: what its rounds achieved in this answer where it ran, else what the cost model
    expects (for CANNOT_PAY, the bound)."""


@dataclass(frozen=True)
class Round:
    index: int
    k: int
    """The draft length asked for this round (0 for a plain step); `drafted` can be fewer (drafted eos, SLEM trim)."""
    pieces: tuple[Piece, ...]
    """Accepted candidates, then the rejected ones, then the target's own token (resampled, bonus or target)."""
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    other_s: float
    algorithm: str = ""
    """What ran this round: none (a plain step), standard, tli or slem; `auto` picks one per round."""
    draft_steps: int = 0
    """Drafter forwards spent this round."""
    stats: Stats | None = None
    """The generation's numbers so far, computed as the final ones are (live equals final)."""
    expected_speedup: float | None = None
    """What auto's cost model expected of this round's (algorithm, k) against plain decoding, when it could tell."""
    declined: tuple[str, int, float] | None = None
    """A plain round of auto's: the best speculating (algorithm, k) it weighed instead, and its expected speedup."""
    bound: Bound | None = None
    """A plain round of auto's on a machine where no draft length can pay: the most speculation could gain there."""
    sources: tuple[Source, ...] = ()
    """auto's rounds: each source it weighs, and why it runs or is off."""

    @property
    def emitted(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.kind != "rejected")

    @classmethod
    def of(cls, record: RoundRecord, **rest) -> Round:
        """The event of a round from its record (`rest`: what the record does not hold, its pieces and stats)."""
        return cls(
            k=record.k,
            drafted=record.drafted,
            accepted=record.accepted,
            draft_s=record.draft_s,
            verify_s=record.verify_s,
            other_s=record.seconds - record.draft_s - record.verify_s,
            algorithm=record.algorithm.value,
            draft_steps=record.draft_steps,
            **rest,
        )


@dataclass(frozen=True)
class Stats:
    algorithm: str
    rounds: int
    drafted: int
    accepted: int
    tokens: int
    wall_s: float
    stop_reason: str | None
    """eos, stop_string, max_tokens or cancelled; None in the live stats of a Round, before the answer has stopped."""
    c: float | None
    """Drafter step time / target single-token step time."""
    v: float | None
    """Verify forward time / target single-token step time."""
    mean_k: float
    """Mean draft length over the rounds that drafted."""
    rounds_by_algorithm: dict = field(default_factory=dict)
    """How many rounds each algorithm ran (plain steps count as none)."""
    drafted_by_algorithm: dict = field(default_factory=dict)
    """Candidates each drafting algorithm proposed (its source: ngram's lookup, or the drafter model's algorithm)."""
    accepted_by_algorithm: dict = field(default_factory=dict)
    """Of those, how many the target kept."""
    forward_s: float = 0.0
    """Seconds inside model forwards (target and drafter, prefill included); the rest of wall_s is overhead."""
    drafting_stopped: str | None = None
    """Why drafting stopped before the answer ended (the drafter's context was full), in plain words; else None."""
    step_s: float | None = None
    """The target's plain step in seconds, the unit of c and v: the mean of this answer's, or the step timed at load
    while the answer has fewer than tally.MIN_PLAIN_STEPS (None until either is known)."""
    prompt_s: float = 0.0
    """Seconds of the target's forward over the prompt, which plain decoding pays as well (part of wall_s)."""
    unreported: tuple[str, ...] = ()
    """What the generation's source did not report, as the UI's stats keys (acceptance_rate, c, ...): a third-party
    server behind the app reports few of the engine's numbers, and a number it did not send is no zero."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    alpha = acceptance_rate

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    tau = tokens_per_round

    @property
    def plain_step_speedup(self) -> float | None:
        """Plain decoding's time for this answer over this answer's, plain decoding's as the plain steps inside it
        measured that (the prompt's forward, then one token per `step_s`): the speedup estimate where no plain run
        compares. None without a plain step, or without a speculative round."""
        plain = self.rounds_by_algorithm.get(PLAIN.value, 0)
        if self.step_s and self.rounds > plain and self.tokens and self.wall_s > 0:
            return (self.prompt_s + self.tokens * self.step_s) / self.wall_s
        return None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of wall time spent outside model forwards: drafting logic, verification, syncing, streaming."""
        return max(0.0, 1.0 - self.forward_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def theoretical_speedup(self) -> float | None:
        from .theory import expected_speedup

        if self.c is None or self.v is None or self.mean_k == 0:
            return None
        return expected_speedup(self.acceptance_rate, round(self.mean_k), self.c, self.v)

    def as_dict(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens": self.tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "stop_reason": self.stop_reason,
            "c": self.c,
            "v": self.v,
            "mean_k": self.mean_k,
            "theoretical_speedup": self.theoretical_speedup,
            "rounds_by_algorithm": dict(self.rounds_by_algorithm),
            "drafted_by_algorithm": dict(self.drafted_by_algorithm),
            "accepted_by_algorithm": dict(self.accepted_by_algorithm),
            "forward_s": self.forward_s,
            "overhead_share": self.overhead_share,
            "drafting_stopped": self.drafting_stopped,
            "step_s": self.step_s,
            "prompt_s": self.prompt_s,
        }


@dataclass(frozen=True)
class Finished:
    text: str
    target_ids: tuple[int, ...]
    """The generated target token ids (the prompt excluded)."""
    stats: Stats
