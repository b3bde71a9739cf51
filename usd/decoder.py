"""The one decode loop: draft -> verify -> commit -> yield. Plain decoding is the same loop with k = 0.

Each model keeps its own token context and KV cache (a runner's `new_context`: usd/runners); a round feeds only the
tokens the cache lacks and crops what the target rejected, so a round costs O(new tokens). The committed answer is held
as target ids; the drafter's context follows the committed *bytes* (its own tokenization of the same text).
docs/design.md walks through the loop, the events and why each algorithm is lossless.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .algorithms import PLAIN, Acceptance, Algorithm, Proposal, runnable
from .drafters import Draft, draft_lookup, draft_strings, draft_tokens, sync_drafter
from .events import Finished, Piece, Round, Stats
from .ngram import NgramIndex
from .pair import Pair, bytes_of, model_context_length
from .record import RoundRecord
from .sampling import DRAFTER_STREAM, SamplingParams, make_generator, position_generator, probabilities
from .schedule import CATCH_UP_MIN, Schedule
from .settings import check_algorithm, check_draft_tokens, check_max_new_tokens
from .tally import Tally
from .utf8 import piece_decoder
from .verify import exact_match, greedy_match, rejection_sampling


def resolve_algorithm(pair: Pair, algorithm: str) -> Algorithm:
    """Check that the algorithm can run on this pair; `auto` stays `auto` (the schedule picks per round: without a
    drafter between plain decoding and the n-gram lookup)."""
    chosen = check_algorithm(algorithm)
    problem = runnable(chosen, pair.drafter is not None, pair.same_tokenizer)
    if problem:
        raise ValueError(problem)
    return chosen


# --- one round -------------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Verdict:
    """What a round's verification decided: the first `accepted` candidates stand, then the target's own `token`
    (`resampled` at the first rejection, `bonus` after a fully accepted draft, `target` when nothing was drafted)."""

    accepted: int
    token: int
    kind: str


def propose(rules: Rules, drafter, mode: Algorithm, k: int, lookup: NgramIndex | None = None) -> Draft:
    proposes, r = mode.spec.proposes, rules
    if proposes is Proposal.NOTHING:
        return Draft()
    if proposes is Proposal.LOOKUP:
        assert lookup is not None  # a generation that looks up keeps the index (Generation)
        return draft_lookup(lookup, k, r.eos)
    if proposes is Proposal.STRINGS:
        return draft_strings(r.pair, drafter, k, r.eos, r.min_confidence)
    return draft_tokens(r.pair, drafter, k, r.params, r.rng.drafter, r.eos, r.min_confidence)


def accept(logits: torch.Tensor, draft: Draft, mode: Algorithm, rules: Rules, position: int) -> Verdict:
    """The algorithm's acceptance rule on the target's logits at each candidate and one past the last."""
    candidates, params, rng = draft.candidates, rules.params, rules.rng
    if params.greedy:
        accepted, token, kind = greedy_match(logits.argmax(-1).tolist(), candidates)
    else:
        p = probabilities(logits, params)
        if mode.spec.accepts is Acceptance.EXACT_MATCH or not candidates:
            accepted, token, kind = exact_match(p, candidates, rng.at_positions(position, len(candidates) + 1))
        else:
            accepted, token, kind = rejection_sampling(p, torch.stack(draft.q), candidates, rng.drafter)
    return Verdict(accepted, token, kind if candidates else "target")


@dataclass(frozen=True)
class RoundTimes:
    draft_s: float
    verify_s: float


def speculative_round(
    rules: Rules, target, drafter, mode: Algorithm, k: int, position: int, target_room: int, lookup=None
) -> tuple[Draft, Verdict, RoundTimes]:
    """One round, as in the paper: the drafter proposes up to k candidates, the target scores all of them in one
    forward, the acceptance rule keeps a prefix and adds one token of the target's own; the target's cache is cut
    back to what stands. (Plain decoding: no candidates, so this is one plain target step.)"""
    t0 = time.perf_counter()
    draft = propose(rules, drafter, mode, k, lookup).fitted(target_room)
    t1 = time.perf_counter()
    n_before = len(target.ids)
    target.ids.extend(draft.candidates)
    logits = target.forward(keep=len(draft.candidates) + 1)
    t2 = time.perf_counter()
    verdict = accept(logits, draft, mode, rules, position)
    target.truncate(n_before + verdict.accepted)
    target.ids.append(verdict.token)
    return draft, verdict, RoundTimes(t1 - t0, t2 - t1)


# --- the committed answer --------------------------------------------------------------------------------------------


class Answer:
    """The committed answer: its target ids and bytes, the text each piece shows, and the stop conditions."""

    def __init__(self, pair: Pair, max_new_tokens: int, stop_strings: tuple[str, ...]):
        self.tb = pair.target_bytes
        self.eos = pair.eos_ids()
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.stop_reach = max((len(s.encode()) for s in self.stop_strings), default=0) + 3  # +3: a cut character
        self.ids: list[int] = []
        self.committed = b""
        self.piece_text = piece_decoder()  # a piece shows the characters it completes; a split one waits for its rest
        self.stop_reason: str | None = None

    def commit(self, draft: Draft, verdict: Verdict, round_index: int, source: str = "") -> list[Piece]:
        """Append what the round emitted, up to a stop; return its pieces: accepted, rejected, then the target's."""
        emitted = draft.candidates[: verdict.accepted] + [verdict.token]
        pieces, new_bytes = [], b""
        for j, t in enumerate(emitted):
            if t in self.eos:  # eos ends the answer and is not part of its text
                self.stop_reason = "eos"
                break
            new_bytes += bytes_of(self.tb, t)
            kind = "accepted" if j < verdict.accepted else verdict.kind
            drafted = j < verdict.accepted
            pieces.append(
                Piece(
                    text=self.piece_text.decode(bytes_of(self.tb, t)),
                    kind=kind,
                    target_id=t,
                    round=round_index,
                    drafter_ids=draft.drafter_ids[j] if drafted else (),
                    source=source if drafted else "",
                    copied_from=_copied(draft, j) if drafted else None,
                )
            )
            if self._ends_with_stop_string(new_bytes):
                self.stop_reason = "stop_string"
            elif len(self.ids) + j + 1 >= self.max_new_tokens:
                self.stop_reason = "max_tokens"
            if self.stop_reason:
                break
        self.ids.extend(emitted[: len(pieces)])  # each piece is the emitted token of the same index
        self.committed += new_bytes
        kept = min(verdict.accepted, len(pieces))
        return pieces[:kept] + self._rejected(draft, verdict, round_index, source) + pieces[kept:]

    def _rejected(self, draft: Draft, verdict: Verdict, round_index: int, source: str) -> list[Piece]:
        return [
            Piece(
                text=bytes_of(self.tb, t).decode("utf-8", "replace"),
                kind="rejected",
                target_id=t,
                round=round_index,
                drafter_ids=draft.drafter_ids[j],
                source=source,
                copied_from=_copied(draft, j),
            )
            for j, t in enumerate(draft.candidates)
            if j >= verdict.accepted
        ]

    def _ends_with_stop_string(self, new: bytes) -> bool:
        """Whether `new`, the round's bytes so far after the committed answer, completed a stop string. A stop string
        they completed lies in the tail they end, so only that tail is read: a check costs the same at any length of
        the answer (joining the whole answer each time would make a long answer's checks quadratic)."""
        if not self.stop_strings:
            return False
        tail = (self.committed[-self.stop_reach :] + new).decode("utf-8", "replace")
        return any(s in tail for s in self.stop_strings)


def _copied(draft: Draft, j: int) -> int | None:
    return None if draft.copied_from is None else draft.copied_from + j


# --- the loop --------------------------------------------------------------------------------------------------------


def _room(limit: int | None, used: int) -> int:
    """How many more positions a model of context `limit` can take after `used` (no limit: any k)."""
    return 1 << 30 if limit is None else limit - used


def _prefill(ctx) -> None:
    """Feed the prompt in one forward, as plain tools do: its last position's logits, which choose the first token, are
    kept by the context (`runners.kept.KeptLogits`), so round 0 reads them again without feeding anything again."""
    ctx.forward(keep=1)


class DrafterState:
    """The drafter's context, prefilled at its first draft (a plain-only run never pays for it), and whether it still
    has room: a drafter with learned positions would crash past its context (IndexError on a CPU, a device assert
    on CUDA), so when it is full the answer goes on plainly, and `stopped` says why."""

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

    def pending(self, answer: Answer) -> int:
        """Positions it would feed before its next draft step: what was committed while it did not draft (before its
        first draft, the prompt and the answer so far, in target tokens as the drafter's count is not known yet)."""
        if not self.ready:
            return self.prompt_len + len(answer.ids)
        return len(self.ctx.ids) - self.ctx.cached

    def room(self, answer: Answer) -> int:
        """How many tokens it may draft now (0 once it is full, for the rest of the answer)."""
        if self.stopped:
            return 0
        if not self.ready:
            self.follow(answer)
        room = _room(self.limit, len(self.ctx.ids))
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

    def follow(self, answer: Answer) -> None:
        self.matched = sync_drafter(self.pair, self.ctx, self.prompt_len, answer.ids, answer.committed, self.matched)


class Generation:
    """One answer in progress: the models' contexts, the schedule, the random streams, the counts and the answer."""

    def __init__(
        self,
        pair: Pair,
        prompt_ids,
        drafter_prompt_ids,
        algorithm: Algorithm | str,
        k,
        params: SamplingParams,
        max_new_tokens: int,
        stop_strings: tuple[str, ...],
        probe_first: bool,
    ):
        algorithm = Algorithm(algorithm)  # a name given: its member (an unknown one fails here, loudly)
        self.pair = pair
        # With a seed, auto only uses modes whose answer the seed fixes (plain and slem, see position_generator), so
        # "same seed, same text" holds for regenerate, for --samples, and between the compare view's two columns.
        seeded = not params.greedy and params.seed is not None
        looks_up = algorithm.chooses or algorithm.spec.proposes is Proposal.LOOKUP
        self.schedule = Schedule(
            pair, algorithm, k, probe_first, seeded_sampling=seeded, lookup=looks_up, answer_tokens=max_new_tokens
        )
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        rng = Randomness(make_generator(params.seed, DRAFTER_STREAM), base_seed)
        self.tally = Tally(algorithm, self.schedule.model.step_at_load)
        self.target = pair.target_runner.new_context(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.lookup = NgramIndex(prompt_ids) if looks_up else None
        """The committed target ids, indexed for n-gram lookup (ngram, and auto)."""
        self.drafter = None
        if algorithm.uses_drafter and pair.drafter is not None:
            self.drafter = DrafterState(pair, drafter_prompt_ids if drafter_prompt_ids is not None else prompt_ids)
        self.answer = Answer(pair, max_new_tokens, stop_strings)
        self.rules = Rules(pair, params, rng, self.answer.eos, self.schedule.min_confidence)
        _prefill(self.target)

    def finish(self) -> None:
        """Leave the target's context holding exactly what plain decoding would have fed: the prompt and the answer
        up to the token before the last one emitted (the end of sequence counts), none of the drafts a speculative
        round fed past a stop. What a generation leaves behind is then the same whatever algorithm ran it."""
        emitted = len(self.answer.ids) + (self.answer.stop_reason == "eos")
        self.target.truncate(self.prompt_len + max(0, emitted - 1))

    def stats(self) -> Stats:
        drafter = self.drafter
        forward_s = self.target.forward_s + (drafter.ctx.forward_s if drafter is not None else 0.0)
        stopped = drafter.stopped if drafter is not None else None
        return self.tally.stats(len(self.answer.ids), self.answer.stop_reason, forward_s, stopped)

    def plan(self) -> tuple[Algorithm, int, int, bool]:
        """(mode, k, the target's room, whether a lookup finds a continuation) for the next round: the schedule's
        choice, fitted to both contexts."""
        found = self.lookup is not None and self.lookup.lookup(1) is not None
        pending = self.drafter.pending(self.answer) if self.drafter is not None else 0
        mode, k = self.schedule.next(found, pending=pending, context=len(self.target.ids))
        target_room = _room(self.pair.context_length, len(self.target.ids))  # the verify positions must fit too
        if mode.needs_drafter:
            assert self.drafter is not None  # the schedule drafts with the model only when the algorithm does
            k = min(k, self.drafter.room(self.answer))
        k = min(k, target_room)
        if k < 1:
            mode, k = PLAIN, 0
        return mode, k, target_room, found

    def step(self) -> Round:
        """Run one round, commit what it emitted, and learn from it."""
        mode, k, target_room, found = self.plan()
        expected = self.schedule.expected_speedup if not mode.plain else None
        t0 = time.perf_counter()
        drafter_ctx = self.drafter.ctx if self.drafter is not None else None
        draft, verdict, times = speculative_round(
            self.rules, self.target, drafter_ctx, mode, k, len(self.answer.ids), target_room, self.lookup
        )
        committed = len(self.answer.ids)
        pieces = self.answer.commit(draft, verdict, self.tally.rounds, mode.value if draft.candidates else "")
        if self.lookup is not None:
            self.lookup.extend(self.answer.ids[committed:])
        if self.drafter is not None and self.drafter.ready and self.answer.stop_reason is None:
            self.drafter.follow(self.answer)
        record = self._record(mode, k, draft, verdict, times, time.perf_counter() - t0)
        self.tally.record(record)
        self.schedule.observe(record)
        return Round.of(
            record,
            index=self.tally.rounds - 1,
            pieces=tuple(pieces),
            stats=self.stats(),
            expected_speedup=expected,
            declined=self.schedule.declined if mode.plain else None,
            bound=self.schedule.bound if mode.plain else None,
            sources=self.schedule.sources(mode, found) if self.schedule.algorithm.chooses else (),
        )

    def _record(self, mode, k, draft: Draft, verdict: Verdict, times: RoundTimes, round_s: float) -> RoundRecord:
        context = len(self.target.ids) - 1 - verdict.accepted  # before the round: it committed its emitted tokens
        setup_s, setup_tokens = self.drafter.bill() if self.drafter is not None else (0.0, 0)
        return RoundRecord(
            algorithm=mode,
            k=k,
            drafted=len(draft.candidates),
            accepted=verdict.accepted,
            draft_steps=draft.steps,
            draft_s=times.draft_s,
            verify_s=times.verify_s,
            round_s=round_s,
            # the target's forward fed the drafts and the token the last round added; round 0 has none (the
            # prompt's last position came with the prompt)
            fed=len(draft.candidates) + (self.tally.rounds > 0),
            setup_s=setup_s,
            setup_tokens=setup_tokens,
            context=context,
        )


def stream(
    pair: Pair,
    prompt_ids: list[int],
    drafter_prompt_ids: list[int] | None = None,
    *,
    algorithm: str = "auto",
    k: int | str = "auto",
    params: SamplingParams | None = None,
    max_new_tokens: int = 128,
    stop_strings: tuple[str, ...] = (),
    cancel: threading.Event | None = None,
    probe_first: bool = True,
) -> Iterator[Round | Finished]:
    """Decode from the target with the drafter's help; yield a Round per target forward and a Finished at the end.

    The output is exactly the target's: token-identical to plain greedy decoding when greedy, and distributed as
    plain sampling otherwise. The models are never modified; both stay usable after a cancel.
    `k` is the draft length (0: plain decoding), or "auto" to adapt it per round. With `probe_first` the rounds are
    plain target steps until one has measured the single-step time behind c and v: round 0 reads the logits the prompt
    left (nothing to time), round 1 feeds a token.
    """
    params = params or SamplingParams()
    algo = resolve_algorithm(pair, algorithm)
    k = 0 if algo.plain else check_draft_tokens(k, allow_zero=True)
    if k == 0:
        algo = PLAIN
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    check_max_new_tokens(max_new_tokens)
    gen = Generation(pair, prompt_ids, drafter_prompt_ids, algo, k, params, max_new_tokens, stop_strings, probe_first)
    try:
        while gen.answer.stop_reason is None:
            if cancel is not None and cancel.is_set():
                gen.answer.stop_reason = "cancelled"
                break
            yield gen.step()
    finally:  # also when the consumer stops early (a client gone): the context is left as plain decoding leaves it
        gen.finish()
    text = pair.target_tokenizer.decode(gen.answer.ids, skip_special_tokens=False)
    yield Finished(text=text, target_ids=tuple(gen.answer.ids), stats=gen.stats())
