"""Drafting without a drafter model: n-gram lookup over the conversation, in the target's own ids (prompt lookup
decoding). The tokens that followed the most recent earlier occurrence of the context's last n tokens are proposed,
for n from N_MAX down to N_MIN (the longest match first). Where an answer repeats what the conversation holds (code
being edited, a quoted document, a revised answer), the continuation is often sitting there, and finding it costs
almost nothing next to a model's step.

Its candidates are a deterministic function of the committed ids, so the verifier treats them as drafts whose
proposal q is one-hot: exact match (the target draws its own token at each position; a candidate stands only if it is
that token) keeps the output distributed as the target's, and greedy output token-identical (docs/design.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass

from .drafting import Draft, Start, cut_after_eos

N_MAX = 8
"""The longest n-gram looked up: a longer match is more likely to continue the same way."""
N_MIN = 3
"""The shortest: a match of one or two tokens continues the same way too seldom to pay for its verify on a CPU, where
verifying a candidate costs a good share of a step (docs/benchmarks.md, "Drafting without a model")."""


@dataclass(frozen=True)
class Lookup:
    """What a lookup found: the proposed ids, and where in the context they were copied from."""

    candidates: list[int]
    source: int
    """The position of the first proposed id's origin in the ids looked up."""
    n: int
    """The length of the n-gram that matched."""


class NgramIndex:
    """Every n-gram (N_MIN <= n <= N_MAX) of a growing sequence of ids, by the position that follows its latest
    occurrence. Updated as ids are appended (O(N_MAX) a token), never rebuilt: the committed ids only grow. An n-gram
    enters the index once an id follows it, so the sequence's own current suffix is never its own match."""

    def __init__(self, ids: list[int] | None = None, n_min: int = N_MIN, n_max: int = N_MAX):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.ids: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        """n-gram -> the position right after its latest occurrence that has something after it."""
        self.extend(ids or [])

    def extend(self, ids: list[int]) -> None:
        for token in ids:
            end = len(self.ids)  # the n-grams ending just before `token` now have a continuation: `token`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.after[tuple(self.ids[end - n : end])] = end
            self.ids.append(token)

    def lookup(self, k: int) -> Lookup | None:
        """Up to k ids that followed the latest earlier occurrence of the longest suffix found (None: no match)."""
        for n in range(min(self.n_max, len(self.ids)), self.n_min - 1, -1):
            start = self.after.get(tuple(self.ids[-n:]))
            if start is not None:
                return Lookup(self.ids[start : start + k], start, n)
        return None


class NgramSource:
    """ngram's source: up to k ids that followed the latest earlier occurrence of the context's last few, cut after an
    end of sequence. No model runs, so no drafter ids and no steps; the proposal is deterministic, q one-hot, so exact
    match verifies it."""

    def __init__(self, start: Start):
        self.index = NgramIndex(start.prompt_ids)
        self.eos = start.rules.eos

    def available(self) -> bool:
        return self.index.lookup(1) is not None

    def room(self) -> int:
        return 1 << 30

    def pending(self) -> int:
        return 0

    def propose(self, k: int) -> Draft:
        found = self.index.lookup(k)
        if found is None:
            return Draft()
        candidates = cut_after_eos(found.candidates, self.eos)
        return Draft(candidates, [], [() for _ in candidates], 0, found.source)

    def commit(self, emitted: list[int]) -> None:
        self.index.extend(emitted)
