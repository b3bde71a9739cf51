"""Drafting with the drafter model: tli and standard sample its tokens in the shared vocabulary, slem has it write
text that the target re-tokenizes (one `ModelSource` each, sharing the model's `DrafterState`); and keeping its
context in step with the committed answer.

Any stopping rule that looks only at the drafter (its confidence, a drafted end-of-sequence) keeps the output
lossless: whether position i+1 is drafted depends only on what came before it, and either way the target's token
there is distributed as p (rejection sampling or exact match when drafted, the bonus or a plain step when not).
"""

from __future__ import annotations

import time

import torch

from .drafting import Draft, Rules, Start
from .pair import Pair, bytes_of, model_context_length
from .runners import DecodingContext
from .sampling import SamplingParams, probabilities, sample
from .utf8 import inside_character, split_utf8, valid_prefix

__all__ = ["Draft", "DrafterState", "ModelSource", "draft_strings", "draft_tokens", "strings", "sync_drafter", "tokens"]

CATCH_UP_MIN = 4
"""Positions the drafter may lack before a draft and still feed with its first draft step; more (its prompt at its
first draft, what was committed while auto decoded plainly) it feeds in a forward of their own first, timed as
catching up (`DrafterState`): a draft step then costs one position, and catching up is priced by its length."""


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


def room_after(limit: int | None, used: int) -> int:
    """How many more positions a model of context `limit` can take after `used` (no limit: any k)."""
    return 1 << 30 if limit is None else limit - used


class DrafterState:
    """The drafter's context, prefilled at its first draft (a plain-only run never pays for it), and whether it still
    has room: a drafter with learned positions would crash past its context (IndexError on a CPU, a device assert
    on CUDA), so when it is full the answer goes on plainly, and `stopped` says why. The model's sources of one answer
    share it (`ModelSource`)."""

    def __init__(self, pair: Pair, prompt_ids: list[int]):
        self.pair = pair
        assert pair.drafter_runner is not None  # a drafter state is made only when the pair has a drafter
        self.ctx = pair.drafter_runner.new_context(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.limit = pair.drafter_context_length or model_context_length(pair.drafter)
        self.ready = False
        self.stopped: str | None = None
        self.unbilled_s = 0.0
        """Seconds of catching up (the prefill included) no round has been charged for yet: kept out of the rounds'
        times, which would bias auto's rates, but counted in what trying the drafter cost."""
        self.unbilled_tokens = 0
        """The positions fed in those seconds, where the context knew what its cache held (after its first forward
        a context knows; before, a cache an earlier answer left may hold part of the prompt)."""
        self.matched = (0, 0)
        """(tokens, bytes) of its generated ids known to spell a prefix of the committed text (`sync_drafter`)."""
        self.followed = -1
        """The answer's length when its context last followed it: its sources each commit a round, it follows once."""

    @property
    def forward_s(self) -> float:
        return self.ctx.forward_s

    def pending(self, answer) -> int:
        """Positions it would feed before its next draft step: what was committed while it did not draft (before its
        first draft, the prompt and the answer so far, in target tokens as the drafter's count is not known yet)."""
        if not self.ready:
            return self.prompt_len + len(answer.ids)
        return len(self.ctx.ids) - self.ctx.cached

    def room(self, answer) -> int:
        """How many tokens it may draft now (0 once it is full, for the rest of the answer)."""
        if self.stopped:
            return 0
        if not self.ready:
            self.follow(answer)
        room = room_after(self.limit, len(self.ctx.ids))
        if room < 1:
            self.stopped = (
                f"the drafter's context ({self.limit:,} tokens) is full: the rest of the answer was "
                "decoded by the target alone"
            )
            return 0
        self._catch_up()
        self.ready = True
        return room

    def _catch_up(self) -> None:
        """Feed all it lacks but the last position, which its first draft step feeds as any step does."""
        lacking = len(self.ctx.ids) - self.ctx.cached
        if lacking <= CATCH_UP_MIN:
            return
        t0 = time.perf_counter()
        last = self.ctx.ids.pop()
        self.ctx.forward(keep=1)
        self.ctx.ids.append(last)
        self.unbilled_s += time.perf_counter() - t0
        if self.ready:
            self.unbilled_tokens += lacking - 1

    def bill(self) -> tuple[float, int]:
        """The unbilled seconds and positions, now charged to a round."""
        billed = (self.unbilled_s, self.unbilled_tokens)
        self.unbilled_s, self.unbilled_tokens = 0.0, 0
        return billed

    def follow(self, answer) -> None:
        if self.followed == len(answer.ids):
            return
        self.matched = sync_drafter(self.pair, self.ctx, self.prompt_len, answer.ids, answer.committed, self.matched)
        self.followed = len(answer.ids)

    def commit(self, answer) -> None:
        """Follow the committed answer, once the drafter has drafted (before, its first draft follows it whole)."""
        if self.ready and answer.stop_reason is None:
            self.follow(answer)


class ModelSource:
    """tli and standard (`tokens`) or slem (`strings`): the drafter model drafts; the sources of one answer share its
    state, kept in the start's `shared` and counted once in its `accounts`."""

    def __init__(self, start: Start, strings: bool):
        self.rules: Rules = start.rules
        self.answer = start.answer
        self.strings = strings
        state = start.shared.get(DrafterState)
        if state is None:
            pair = start.rules.pair
            prompt = start.drafter_prompt_ids if start.drafter_prompt_ids is not None else start.prompt_ids
            state = start.shared[DrafterState] = DrafterState(pair, prompt)
            start.accounts.append(state)
        self.state: DrafterState = state

    def available(self) -> bool:
        return self.state.stopped is None

    def room(self) -> int:
        return self.state.room(self.answer)

    def pending(self) -> int:
        return self.state.pending(self.answer)

    def propose(self, k: int) -> Draft:
        r, ctx = self.rules, self.state.ctx
        if self.strings:
            return draft_strings(r.pair, ctx, k, r.eos, r.min_confidence)
        return draft_tokens(r.pair, ctx, k, r.params, r.rng.drafter, r.eos, r.min_confidence)

    def commit(self, emitted: list[int]) -> None:
        self.state.commit(self.answer)


def tokens(start: Start) -> ModelSource:
    """tli's and standard's source: the drafter's own tokens, sampled in the vocabulary it shares with the target."""
    return ModelSource(start, strings=False)


def strings(start: Start) -> ModelSource:
    """slem's source: the drafter's text, re-tokenized by the target."""
    return ModelSource(start, strings=True)
