"""The one decode loop: draft -> verify -> commit -> yield. Plain decoding is the same loop with k = 0.

Each model keeps its own token context and KV cache (`Context`); a round feeds only the tokens the cache lacks and
crops what the target rejected, so a round costs O(new tokens). The committed answer is held as target ids; the
drafter's context follows the committed *bytes* (its own tokenization of the same text).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import torch

from .drafters import draft_strings, draft_tokens, sync_drafter
from .events import Finished, Piece, Round, Stats
from .pair import Context, Pair, bytes_of, model_context_length
from .sampling import DRAFTER_STREAM, SamplingParams, make_generator, position_generator, probabilities
from .schedule import Schedule
from .utf8 import piece_decoder
from .verify import exact_match, greedy_match, rejection_sampling

ALGORITHMS = ("auto", "standard", "tli", "slem", "none")


def resolve_algorithm(pair: Pair, algorithm: str) -> str:
    """Check that the algorithm can run on this pair; `auto` stays `auto` (the schedule picks per round)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm == "auto" and pair.drafter is None:
        return "none"
    if algorithm != "none" and pair.drafter is None:
        raise ValueError(f"algorithm {algorithm!r} needs a drafter; load one or use 'none'")
    if algorithm == "standard" and not pair.same_tokenizer:
        raise ValueError("'standard' needs identical tokenizers; this pair differs, use tli, slem or auto")
    return algorithm


def _check_k(k) -> int | str:
    if k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
        raise ValueError(f"draft tokens must be 'auto' or a whole number from 0 to 64, got {k!r}")
    return k


def _room(limit: int | None, used: int) -> int:
    """How many more positions a model of context `limit` can take after `used` (no limit: any k)."""
    return 1 << 30 if limit is None else limit - used


def _tail_text(text: bytes, new: int, stop_strings: tuple[str, ...]) -> str:
    """The end of the answer that a stop string completed by the last `new` bytes must lie in."""
    window = new + max(len(s.encode()) for s in stop_strings) + 3  # +3: a character split at the window's start
    return text[-window:].decode("utf-8", "replace")


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
    `k` is the draft length, or "auto" to adapt it per round. With `probe_first` the first round is a plain target
    step, which measures the single-step time behind c and v.
    """
    params = params or SamplingParams()
    algo = resolve_algorithm(pair, algorithm)
    k = 0 if algo == "none" else _check_k(k)
    if k == 0:
        algo = "none"
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop_strings = tuple(s for s in stop_strings if s)
    # With a seed, auto only uses modes whose answer the seed fixes (plain and slem, see position_generator), so
    # "same seed, same text" holds for regenerate, for --samples, and between the compare view's two columns.
    schedule = Schedule(pair, algo, k, probe_first, seeded_sampling=not params.greedy and params.seed is not None)
    g = make_generator(params.seed, DRAFTER_STREAM)  # drafter samples and rejection-sampling uniforms
    base_seed = params.seed if params.seed is not None else secrets.randbits(63)  # keys the target's own draws
    t_start = time.perf_counter()
    target = Context(pair.target, prompt_ids)
    tb = pair.target_bytes
    eos = pair.eos_ids()
    drafter = None
    if algo != "none":
        drafter = Context(pair.drafter, drafter_prompt_ids if drafter_prompt_ids is not None else prompt_ids)
        drafter_prompt_len = len(drafter.ids)

    generated: list[int] = []
    committed = b""  # the generated text's bytes
    piece_text = piece_decoder()  # a piece shows the characters it completes; a split one waits for its rest
    rounds = drafted_total = accepted_total = 0
    by_algorithm: dict[str, int] = {}
    t_plain, t_verify, t_draft_step = [], [], []
    stop_reason = drafting_stopped = None
    target_limit = pair.context_length
    drafter_limit = (pair.drafter_context_length or model_context_length(pair.drafter)) if drafter else None

    def prefill(ctx: Context) -> None:
        """Feed all but the last prompt token, so that later steps feed only what is new."""
        if len(ctx.ids) > 1:
            last = ctx.ids.pop()
            ctx.forward(keep=1)
            ctx.ids.append(last)

    prefill(target)  # before round 0, so round 0 is a true single-token target step
    drafter_ready = False  # the drafter is prefilled at its first draft: a plain-only run never pays for it

    while stop_reason is None:
        if cancel is not None and cancel.is_set():
            stop_reason = "cancelled"
            break
        mode, k_round = schedule.next()
        if mode != "none" and drafting_stopped is None:
            if not drafter_ready:
                sync_drafter(pair, drafter, drafter_prompt_len, generated, committed)
            # Neither model may be fed past its context: the target verifies k_round positions past its ids, the
            # drafter writes k_round past its own. A drafter with learned positions would crash (IndexError on a
            # CPU, a device assert on CUDA); when it has no room left, the answer goes on plainly.
            k_round = min(k_round, _room(target_limit, len(target.ids)), _room(drafter_limit, len(drafter.ids)))
            if _room(drafter_limit, len(drafter.ids)) < 1:
                drafting_stopped = (f"the drafter's context ({drafter_limit:,} tokens) is full: the rest of the "
                                    "answer was decoded by the target alone")  # fmt: skip
        if mode != "none" and (drafting_stopped is not None or k_round < 1):
            mode, k_round = "none", 0
        if mode != "none" and not drafter_ready:
            prefill(drafter)  # a one-time cost, kept out of the round's time so it does not bias auto's choice
            drafter_ready = True
        t0 = time.perf_counter()
        if mode == "none":
            candidates, q, drafter_ids = [], [], []
        else:
            if mode == "slem":
                draft = draft_strings(pair, drafter, k_round, eos, schedule.min_confidence)
            else:
                draft = draft_tokens(pair, drafter, k_round, params, g, eos, schedule.min_confidence)
            # slem's re-tokenized text can hold more target tokens than the drafter wrote: keep what fits the target
            room = _room(target_limit, len(target.ids))
            candidates, q, drafter_ids = draft.candidates[:room], draft.q[:room], draft.drafter_ids[:room]
            if draft.steps:
                t_draft_step.append((time.perf_counter() - t0) / draft.steps)
        t1 = time.perf_counter()
        n_before = len(target.ids)
        target.ids.extend(candidates)
        logits = target.forward(keep=len(candidates) + 1)
        t2 = time.perf_counter()
        (t_verify if candidates else t_plain).append(t2 - t1)
        if params.greedy:
            accepted, token, kind = greedy_match(logits.argmax(-1).tolist(), candidates)
        else:
            p = probabilities(logits, params)
            if mode == "slem" or not candidates:
                gens = [position_generator(base_seed, len(generated) + i) for i in range(len(candidates) + 1)]
                accepted, token, kind = exact_match(p, candidates, gens)
            else:
                accepted, token, kind = rejection_sampling(p, torch.stack(q), candidates, g)
        if not candidates:
            kind = "target"
        target.truncate(n_before + accepted)
        target.ids.append(token)
        emitted_ids = candidates[:accepted] + [token]

        # stop conditions: eos (not part of the text), max tokens (mid-round), stop strings
        keep = len(emitted_ids)
        for j, t in enumerate(emitted_ids):
            if t in eos:
                keep, stop_reason = j, "eos"
                break
            if len(generated) + j + 1 >= max_new_tokens:
                keep, stop_reason = j + 1, "max_tokens"
                break
        pieces = []
        new_bytes = b""
        for j in range(keep):
            t = emitted_ids[j]
            new_bytes += bytes_of(tb, t)
            text = piece_text.decode(bytes_of(tb, t))
            kind_j = "accepted" if j < accepted else kind
            dids = drafter_ids[j] if j < accepted else ()
            pieces.append(Piece(text, kind_j, t, rounds, dids))
            if stop_strings and any(s in _tail_text(committed + new_bytes, len(new_bytes), stop_strings)
                                    for s in stop_strings):  # fmt: skip
                keep, stop_reason = j + 1, "stop_string"
                break
        rejected = [Piece(bytes_of(tb, t).decode("utf-8", "replace"), "rejected", t, rounds, drafter_ids[j])
                    for j, t in enumerate(candidates) if j >= accepted]  # fmt: skip
        generated.extend(emitted_ids[:keep])
        committed += new_bytes
        accepted_in_text = min(accepted, keep)
        pieces = pieces[:accepted_in_text] + rejected + pieces[accepted_in_text:keep]
        drafted_total += len(candidates)
        accepted_total += accepted
        rounds += 1
        by_algorithm[mode] = by_algorithm.get(mode, 0) + 1

        if drafter_ready and stop_reason is None:
            sync_drafter(pair, drafter, drafter_prompt_len, generated, committed)
        t3 = time.perf_counter()
        schedule.observe(mode, k_round, len(candidates), accepted, len(emitted_ids), t3 - t0)
        yield Round(rounds - 1, k_round, tuple(pieces), len(candidates), accepted,
                    t1 - t0, t2 - t1, t3 - t2, mode)  # fmt: skip

    wall = time.perf_counter() - t_start
    t_step = sum(t_plain) / len(t_plain) if t_plain else None
    c = (sum(t_draft_step) / len(t_draft_step) / t_step) if (t_step and t_draft_step) else None
    v = (sum(t_verify) / len(t_verify) / t_step) if (t_step and t_verify) else None
    stats = Stats(algo, rounds, drafted_total, accepted_total, len(generated), wall, stop_reason, c, v,
                  drafted_total / len(t_verify) if t_verify else 0.0, by_algorithm,
                  target.forward_s + (drafter.forward_s if drafter is not None else 0.0),
                  drafting_stopped)  # fmt: skip
    text = pair.target_tokenizer.decode(generated, skip_special_tokens=False)
    yield Finished(text, tuple(generated), stats)
