"""The one decode loop: draft -> verify -> commit -> yield. Plain decoding is the same loop with k = 0.

Each model keeps its own token context and KV cache (`Context`); a round feeds only the tokens the cache lacks and
crops what the target rejected, so a round costs O(new tokens). The committed answer is held as target ids; the
drafter's context follows the committed *bytes* (its own tokenization of the same text).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .events import Finished, Piece, Round, Stats
from .sampling import SamplingParams, make_generator, probabilities, sample
from .verify import exact_match, greedy_match, rejection_sampling
from .vocab import TokenizerBytes, align, tokenizer_bytes

ALGORITHMS = ("none", "standard", "tli", "slem", "auto")


class Context:
    """A model, the token ids it has seen, and its KV cache over all but the not-yet-fed tail."""

    def __init__(self, model, ids: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.ids = list(ids)
        self.cache = DynamicCache(config=model.config)
        self.cached = 0

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        if self.cached > n:
            self.cache.crop(n - self.cached)  # transformers 5: a negative count of tokens to drop
            self.cached = n

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Feed every id the cache lacks; return their logits [new, V] (float32, on CPU)."""
        if self.cached == len(self.ids):  # nothing new: re-feed the last token to get its logits again
            self.cache.crop(-1)
            self.cached -= 1
        device = self.model.device
        new = torch.tensor([self.ids[self.cached :]], device=device)
        out = self.model(input_ids=new, past_key_values=self.cache, use_cache=True)
        self.cached = len(self.ids)
        return out.logits[0].float().cpu()


def _utf8_complete(b: bytes) -> bytes:
    """The longest prefix of b that ends on a whole UTF-8 character (hold back a split multi-byte character)."""
    for cut in range(len(b), max(-1, len(b) - 4), -1):
        try:
            b[:cut].decode("utf-8")
            return b[:cut]
        except UnicodeDecodeError:
            continue
    return b""


def _tail_text(text: bytes, new: int, stop_strings: tuple[str, ...]) -> str:
    """The end of the answer that a stop string completed by the last `new` bytes must lie in."""
    window = new + max(len(s.encode()) for s in stop_strings) + 3  # +3: a character split at the window's start
    return text[-window:].decode("utf-8", "replace")


def _bytes_of(tb: TokenizerBytes, i: int) -> bytes:
    b = tb.bytes_of.get(i)
    return b if b is not None else tb.specials.get(i, "").encode()


@dataclass
class Pair:
    """A loaded (target, drafter) pair with what the algorithms need to know about their vocabularies."""

    target: object
    target_tokenizer: object
    drafter: object | None = None
    drafter_tokenizer: object | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def same_tokenizer(self) -> bool:
        if self.drafter_tokenizer is None:
            return False
        if "same" not in self._cache:
            a, b = self.target_tokenizer, self.drafter_tokenizer
            self._cache["same"] = a.get_vocab() == b.get_vocab()
        return self._cache["same"]

    @property
    def target_bytes(self) -> TokenizerBytes:
        if "tb" not in self._cache:
            self._cache["tb"] = tokenizer_bytes(self.target_tokenizer)
        return self._cache["tb"]

    @property
    def drafter_bytes(self) -> TokenizerBytes:
        if "db" not in self._cache:
            self._cache["db"] = tokenizer_bytes(self.drafter_tokenizer)
        return self._cache["db"]

    def intersection(self):
        """TLI's map from drafter to target vocabulary, built once per pair: (drafter ids in I, their target ids,
        target vocab size, a [vocab_d] mask of I, a [vocab_d] drafter->target id table with -1 outside I)."""
        if "map" not in self._cache:
            vocab_t = self.target.get_output_embeddings().weight.shape[0]
            vocab_d = self.drafter.get_output_embeddings().weight.shape[0]
            if self.same_tokenizer:
                d_ids = list(range(min(vocab_t, vocab_d)))
                t_ids = d_ids
            else:
                d2t = align(self.target_tokenizer, self.drafter_tokenizer).drafter_to_target
                pairs = sorted((d, t) for d, t in d2t.items() if d < vocab_d and t < vocab_t)
                d_ids, t_ids = [d for d, _ in pairs], [t for _, t in pairs]
            d_ids, t_ids = torch.tensor(d_ids, dtype=torch.long), torch.tensor(t_ids, dtype=torch.long)
            allowed = torch.zeros(vocab_d, dtype=torch.bool)
            allowed[d_ids] = True
            to_target = torch.full((vocab_d,), -1, dtype=torch.long)
            to_target[d_ids] = t_ids
            self._cache["map"] = (d_ids, t_ids, vocab_t, allowed, to_target)
        return self._cache["map"]

    def eos_ids(self) -> set[int]:
        ids = set(self.target_bytes.eos_ids)
        gen = getattr(self.target, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids


def resolve_algorithm(pair: Pair, algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm != "none" and pair.drafter is None:
        raise ValueError(f"algorithm {algorithm!r} needs a drafter; load one or use 'none'")
    if algorithm == "standard" and not pair.same_tokenizer:
        raise ValueError("'standard' needs identical tokenizers; this pair differs, use tli, slem or auto")
    if algorithm == "auto":
        return "standard" if pair.same_tokenizer else "tli"
    return algorithm


def stream(
    pair: Pair,
    prompt_ids: list[int],
    drafter_prompt_ids: list[int] | None = None,
    *,
    algorithm: str = "auto",
    k: int = 4,
    params: SamplingParams | None = None,
    max_new_tokens: int = 128,
    stop_strings: tuple[str, ...] = (),
    cancel: threading.Event | None = None,
    probe_first: bool = True,
) -> Iterator[Round | Finished]:
    """Decode from the target with the drafter's help; yield a Round per target forward and a Finished at the end.

    The output is exactly the target's: token-identical to plain greedy decoding when greedy, and distributed as
    plain sampling otherwise. The models are never modified; both stay usable after a cancel.
    With `probe_first` the first round is a plain target step, which measures the single-step time behind c and v.
    """
    params = params or SamplingParams()
    algo = resolve_algorithm(pair, algorithm)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    k = 0 if algo == "none" else k
    g = make_generator(params.seed)
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
    emitted_text = b""  # bytes already handed out as piece text (whole characters only)
    rounds = drafted_total = accepted_total = 0
    t_plain, t_verify, t_draft_step = [], [], []
    stop_reason = None

    # Prefill all but the last prompt token outside the rounds, so round 0 is a true single-token target step.
    for ctx in (target, drafter):
        if ctx is not None and len(ctx.ids) > 1:
            last = ctx.ids.pop()
            ctx.forward()
            ctx.ids.append(last)

    while stop_reason is None:
        if cancel is not None and cancel.is_set():
            stop_reason = "cancelled"
            break
        t0 = time.perf_counter()
        k_round = 0 if (rounds == 0 and probe_first) else k
        candidates: list[int] = []
        q_rows: list[torch.Tensor] = []
        cand_drafter_ids: list[tuple[int, ...]] = []
        if k_round > 0:
            candidates, q_rows, cand_drafter_ids = _draft(pair, algo, drafter, k_round, params, g, eos)
            if candidates:
                t_draft_step.append((time.perf_counter() - t0) / k_round)
        t1 = time.perf_counter()
        n_before = len(target.ids)
        target.ids.extend(candidates)
        logits = target.forward()[-(len(candidates) + 1) :]
        t2 = time.perf_counter()
        (t_verify if candidates else t_plain).append(t2 - t1)
        if params.greedy:
            accepted, token, kind = greedy_match(logits.argmax(-1).tolist(), candidates)
        else:
            p = probabilities(logits, params)
            if algo == "slem":
                accepted, token, kind = exact_match(p, candidates, g)
            elif candidates:
                accepted, token, kind = rejection_sampling(p, torch.stack(q_rows), candidates, g)
            else:
                accepted, token, kind = 0, sample(p[0], g), "bonus"
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
            new_bytes += _bytes_of(tb, t)
            # a piece shows the whole characters it completes; a split multi-byte character waits for its rest
            whole = _utf8_complete(committed + new_bytes)
            text, emitted_text = whole[len(emitted_text) :].decode("utf-8"), whole
            kind_j = "accepted" if j < accepted else kind
            dids = cand_drafter_ids[j] if j < accepted else ()
            pieces.append(Piece(text, kind_j, t, rounds, dids))
            if stop_strings and any(s in _tail_text(committed + new_bytes, len(new_bytes), stop_strings)
                                    for s in stop_strings):  # fmt: skip
                keep, stop_reason = j + 1, "stop_string"
                break
        rejected = [Piece(_bytes_of(tb, t).decode("utf-8", "replace"), "rejected", t, rounds, cand_drafter_ids[j])
                    for j, t in enumerate(candidates) if j >= accepted]  # fmt: skip
        generated.extend(emitted_ids[:keep])
        committed += new_bytes
        accepted_in_text = min(accepted, keep)
        pieces = pieces[:accepted_in_text] + rejected + pieces[accepted_in_text:keep]
        drafted_total += len(candidates)
        accepted_total += accepted
        rounds += 1

        if drafter is not None and stop_reason is None:
            _sync_drafter(pair, drafter, drafter_prompt_len, generated, committed)
        t3 = time.perf_counter()
        yield Round(rounds - 1, k_round, tuple(pieces), len(candidates), accepted,
                    t1 - t0, t2 - t1, t3 - t2)  # fmt: skip

    wall = time.perf_counter() - t_start
    t_step = sum(t_plain) / len(t_plain) if t_plain else None
    c = (sum(t_draft_step) / len(t_draft_step) / t_step) if (t_step and t_draft_step) else None
    v = (sum(t_verify) / len(t_verify) / t_step) if (t_step and t_verify) else None
    stats = Stats(algo, rounds, drafted_total, accepted_total, len(generated), wall, stop_reason, c, v,
                  drafted_total / len(t_verify) if t_verify else 0.0)  # fmt: skip
    text = pair.target_tokenizer.decode(generated, skip_special_tokens=False)
    yield Finished(text, tuple(generated), stats)


def _draft(pair: Pair, algo: str, drafter: Context, k: int, params: SamplingParams, g, eos: set[int]):
    """Propose up to k candidates in target ids. Returns (candidates, q rows over target ids, drafter ids each)."""
    if algo == "slem":
        return _draft_slem(pair, drafter, k, eos)
    d_ids, t_ids, vocab_t, allowed, to_target = pair.intersection()
    vocab_d = allowed.shape[0]
    candidates, q_rows, dids = [], [], []
    for _ in range(k):
        logits = drafter.forward()[-1][:vocab_d]
        logits = logits.masked_fill(~allowed[: logits.shape[0]], float("-inf"))
        q_d = probabilities(logits, params)
        d = int(q_d.argmax()) if params.greedy else sample(q_d, g)
        drafter.ids.append(d)
        t = int(to_target[d])
        if not params.greedy:
            # q over target ids: several drafter ids may spell the same target token; their mass adds up
            q_rows.append(torch.zeros(vocab_t).index_add_(0, t_ids, q_d[d_ids]))
        candidates.append(t)
        dids.append((d,))
        if t in eos:
            break
    return candidates, q_rows, dids


def _draft_slem(pair: Pair, drafter: Context, k: int, eos: set[int]):
    db = pair.drafter_bytes
    d_eos = db.eos_ids
    drafted, ended = [], False
    for _ in range(k):
        # Exact match keeps a candidate with probability p(candidate), which the mode maximises: so the drafter
        # proposes its own argmax even when the user samples (the target's draws alone decide the output).
        d = int(drafter.forward()[-1].argmax())
        drafter.ids.append(d)
        if d in d_eos:
            ended = True
            break
        drafted.append(d)
    text = _utf8_complete(b"".join(_bytes_of(db, d) for d in drafted)).decode("utf-8")
    candidates = pair.target_tokenizer.encode(text, add_special_tokens=False) if text else []
    if ended:
        candidates = candidates + sorted(eos)[:1]
    elif len(candidates) > 1:
        candidates = candidates[:-1]  # the last token could still merge with text the drafter has not written
    return candidates, [], [() for _ in candidates]


def _sync_drafter(pair: Pair, drafter: Context, prompt_len: int, generated: list[int], committed: bytes) -> None:
    """Keep the drafter's context in step with the committed text: keep its longest token prefix whose bytes are a
    prefix of the committed text (minus one token, so the boundary word re-tokenizes whole), re-tokenize the rest."""
    if pair.same_tokenizer:
        gen = drafter.ids[prompt_len:]
        same = 0
        while same < min(len(gen), len(generated)) and gen[same] == generated[same]:
            same += 1
        drafter.truncate(prompt_len + same)
        drafter.ids.extend(generated[same:])
        return
    db = pair.drafter_bytes
    gen = drafter.ids[prompt_len:]
    keep, pos = 0, 0
    for d in gen:
        b = _bytes_of(db, d)
        if b and committed.startswith(b, pos):
            keep += 1
            pos += len(b)
        else:
            break
    if keep and pos < len(committed):
        keep -= 1
        pos -= len(_bytes_of(db, gen[keep]))
    tail = _utf8_complete(committed[pos:])
    drafter.truncate(prompt_len + keep)
    if tail:
        drafter.ids.extend(pair.drafter_tokenizer.encode(tail.decode("utf-8"), add_special_tokens=False))
