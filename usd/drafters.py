"""Drafting: propose candidates in the target's token space, one function per way of drafting; and keeping the
drafter's context in step with the committed answer.

Any stopping rule that looks only at the drafter (its confidence, a drafted end-of-sequence) keeps the output
lossless: whether position i+1 is drafted depends only on what came before it, and either way the target's token
there is distributed as p (rejection sampling or exact match when drafted, the bonus or a plain step when not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ngram import NgramIndex
from .pair import Pair, bytes_of
from .runners import DecodingContext
from .sampling import SamplingParams, probabilities, sample
from .utf8 import inside_character, split_utf8, valid_prefix


@dataclass
class Draft:
    candidates: list[int] = field(default_factory=list)
    """Proposed target ids."""
    q: list[torch.Tensor] = field(default_factory=list)
    """Per candidate, the distribution it was drawn from over target ids (empty when greedy or for SLEM)."""
    drafter_ids: list[tuple[int, ...]] = field(default_factory=list)
    """Per candidate, the drafter ids behind it (empty for SLEM, whose candidates come from re-tokenized text)."""
    steps: int = 0
    """Drafter forwards spent."""
    copied_from: int | None = None
    """A lookup's draft: the position its first candidate was copied from (the others follow it)."""

    def fitted(self, room: int) -> Draft:
        """At most `room` candidates: slem's re-tokenized text can hold more target tokens than the drafter wrote,
        and the target must not be fed past its context."""
        if len(self.candidates) <= room:
            return self
        return Draft(self.candidates[:room], self.q[:room], self.drafter_ids[:room], self.steps, self.copied_from)


def _confidence(logits: torch.Tensor) -> float:
    """The drafter's own top probability (temperature 1), whatever the user's settings."""
    return float(logits.softmax(-1).max())


def draft_tokens(
    pair: Pair, drafter: DecodingContext, k: int, params: SamplingParams, g, eos: set[int], min_confidence: float = 0.0
) -> Draft:
    """standard and tli: sample the drafter with its logits outside the shared vocabulary I masked, so q lives on I
    and each proposal is a target id; with identical tokenizers I is the whole vocabulary."""
    d_ids, t_ids, vocab_t = pair.intersection()
    out = Draft()
    for _ in range(k):
        # the drafter's logits on I only: index j stands for drafter id d_ids[j] and target id t_ids[j]
        logits = drafter.forward(keep=1)[-1][d_ids]
        out.steps += 1
        if min_confidence and _confidence(logits) < min_confidence:
            break
        q_i = probabilities(logits, params)
        j = int(q_i.argmax()) if params.greedy else sample(q_i, g)
        d, t = int(d_ids[j]), int(t_ids[j])
        drafter.ids.append(d)
        if not params.greedy:
            out.q.append(target_proposal(q_i, t_ids, vocab_t))
        out.candidates.append(t)
        out.drafter_ids.append((d,))
        if t in eos:
            break
    return out


def target_proposal(q_shared: torch.Tensor, t_ids: torch.Tensor, vocab_t: int) -> torch.Tensor:
    """q over the target's ids from q over the shared vocabulary (index j: drafter id d_ids[j], target id t_ids[j]):
    several drafter ids may spell one target token (a piece and its byte-fallback spelling), and their mass adds up.
    Taking one spelling's alone would bias the output (docs/design.md §5, tli)."""
    return torch.zeros(vocab_t).index_add_(0, t_ids, q_shared)


def draft_lookup(index: NgramIndex, k: int, eos: set[int]) -> Draft:
    """ngram: up to k ids that followed the latest earlier occurrence of the answer's last few (usd/ngram.py), cut
    after an end of sequence (nothing is drafted past the end). No model runs, so no drafter ids and no steps; the
    proposal is deterministic, q one-hot, so exact match verifies it."""
    found = index.lookup(k)
    if found is None:
        return Draft()
    end = next((i + 1 for i, t in enumerate(found.candidates) if t in eos), len(found.candidates))
    candidates = found.candidates[:end]
    return Draft(candidates, [], [() for _ in candidates], 0, found.source)


def draft_strings(pair: Pair, drafter: DecodingContext, k: int, eos: set[int], min_confidence: float = 0.0) -> Draft:
    """slem: the drafter writes up to k tokens in its own vocabulary; their text, re-tokenized by the target's
    tokenizer, gives the candidates."""
    db = pair.drafter_bytes
    out = Draft()
    drafted, ended = [], False
    for _ in range(k):
        logits = drafter.forward(keep=1)[-1]
        out.steps += 1
        if min_confidence and _confidence(logits) < min_confidence:
            break
        # Exact match keeps a candidate with probability p(candidate), which the mode maximises: so the drafter
        # proposes its own argmax even when the user samples (the target's draws alone decide the output).
        d = int(logits.argmax())
        drafter.ids.append(d)
        if d in db.eos_ids:
            ended = True
            break
        drafted.append(d)
    text = valid_prefix(b"".join(bytes_of(db, d) for d in drafted))
    candidates = pair.target_tokenizer.encode(text, add_special_tokens=False) if text else []
    if ended:  # the drafter ended its answer: propose the target's own end of turn
        primary = pair.target_tokenizer.eos_token_id
        candidates = candidates + [primary if primary in eos else min(eos)]
    elif len(candidates) > 1:
        candidates = candidates[:-1]  # the last token could still merge with text the drafter has not written
    out.candidates = candidates
    out.drafter_ids = [() for _ in candidates]
    return out


def sync_drafter(
    pair: Pair,
    drafter: DecodingContext,
    prompt_len: int,
    generated: list[int],
    committed: bytes,
    matched: tuple[int, int] = (0, 0),
) -> tuple[int, int]:
    """Keep the drafter's context in step with the committed text: keep its longest token prefix whose bytes are a
    prefix of the committed text (minus one token, so the boundary word re-tokenizes whole), re-tokenize the rest.
    Only the tail is re-tokenized and re-fed; the cache keeps the rest. `matched`: (tokens, bytes) of the drafter's
    generated ids known, from the last call, to spell a prefix of the committed text; returns the new one."""
    gen = drafter.ids[prompt_len:]
    if pair.same_tokenizer:
        same = 0
        while same < min(len(gen), len(generated)) and gen[same] == generated[same]:
            same += 1
        drafter.truncate(prompt_len + same)
        drafter.ids.extend(generated[same:])
        return matched
    db = pair.drafter_bytes
    # The tokens matched last time still match (the committed text only grows): start after them.
    keep, pos = matched if matched[0] <= len(gen) else (0, 0)
    for d in gen[keep:]:
        b = bytes_of(db, d)
        if b and committed.startswith(b, pos):
            keep += 1
            pos += len(b)
        else:
            break
    # Back off one token, and on to a character boundary: a cut inside a character re-tokenizes as garbage.
    if keep and pos < len(committed):
        keep -= 1
        pos -= len(bytes_of(db, gen[keep]))
        while keep and inside_character(committed, pos):
            keep -= 1
            pos -= len(bytes_of(db, gen[keep]))
    drafter.truncate(prompt_len + keep)
    drafter.ids.extend(encode_bytes(pair, committed[pos:]))
    return keep, pos


def encode_bytes(pair: Pair, data: bytes) -> list[int]:
    """The drafter's tokens for `data`, whatever bytes it holds: text through its tokenizer, each invalid byte as the
    drafter's own token for that byte, so its context spells the committed text exactly and stays in step with it.
    A valid incomplete character at the end waits for its rest."""
    tokenizer = pair.drafter_tokenizer
    assert tokenizer is not None  # only called to follow a drafter (sync_drafter), which comes with its tokenizer
    ids = []
    for run in split_utf8(data):
        if isinstance(run, str):
            ids += tokenizer.encode(run, add_special_tokens=False)
        else:  # a drafter without a token for some byte sees U+FFFD there, and resyncs from it each round
            byte_ids = pair.drafter_byte_ids()
            ids += (
                [byte_ids[b] for b in run]
                if all(b in byte_ids for b in run)
                else tokenizer.encode("\ufffd", add_special_tokens=False)
            )
    return ids
