"""A loaded (target, drafter) pair, and the per-model decoding context (token ids + KV cache) the loop works on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .recurrent import RecurrentStates, is_recurrent
from .vocab import TokenizerBytes, align, same_vocabulary, tokenizer_bytes


class LastLogits:
    """The logits of the last position a context fed, while its ids up to there stand. The loop reads a prompt's last
    position twice: when the prompt is fed (in one forward, as plain tools read it, so the first token is chosen on the
    same bits as theirs) and as the first row of round 0's verify. Keeping the row spares feeding that position again,
    which on the llama.cpp runner would mean feeding its whole prompt batch again (docs/design.md §8)."""

    def __init__(self):
        self.position = -1
        self.row: torch.Tensor | None = None

    def keep(self, logits: torch.Tensor, n_ids: int) -> None:
        if len(logits):
            self.position, self.row = n_ids - 1, logits[-1].clone()  # a copy: callers may change what they got

    def drop_from(self, n: int) -> None:
        """The ids from n on are gone (a rollback): a kept row there no longer holds."""
        if self.position >= n:
            self.position, self.row = -1, None

    def first_of(self, n_ids: int, n_out: int) -> torch.Tensor | None:
        """The kept row, if it is the first of the last `n_out` positions of `n_ids` ids."""
        return self.row if n_out > 0 and self.position == n_ids - n_out else None


class Context:
    """A model, the token ids it has seen, and its KV cache over all but the not-yet-fed tail."""

    def __init__(self, model, ids: list[int]):
        self.model = model
        self.ids = list(ids)
        self.cache = self._new_cache()
        self.cached = 0
        self.fed_since_crop = 0
        self.last = LastLogits()
        self.matched = (0, 0)
        """(tokens, bytes) of the generated ids known to spell a prefix of the committed text (drafter sync)."""
        self.forward_s = 0.0
        """Seconds spent inside model forwards: the rest of a round's time is the loop's own overhead."""

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # Sliding-window layers (Gemma 3: 512 tokens) drop states that leave the window as they go; recording keeps
        # them until the next crop, so a rejected draft can be rolled back. Recurrent layers cannot be cropped at all:
        # their states are snapshot instead (usd/recurrent.py).
        self.sliding = False
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording") and not is_recurrent(layer):
                layer.activate_past_recording()
                self.sliding = True
        recurrent = RecurrentStates(cache)
        self.recurrent = recurrent if recurrent.layers else None
        return cache

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        self.last.drop_from(n)
        if self.cached > n:
            self._rollback(self.cached - n)

    def _rollback(self, drop: int) -> None:
        if self.sliding and drop > self.fed_since_crop:
            # A sliding-window layer kept only what was fed since its last crop: anything older is gone, so start
            # the cache again (rare: the drafter's resync never reaches behind the previous round).
            self._start_again()
        elif self.recurrent is not None:
            if self.recurrent.roll_back(self.cached - drop, drop):
                self.cached -= drop
            else:
                self._start_again()
        else:
            self.cache.crop(-drop)  # transformers 5: a negative count of tokens to drop
            self.cached -= drop
        self.fed_since_crop = 0

    def _start_again(self) -> None:
        self.cache, self.cached = self._new_cache(), 0

    @torch.inference_mode()
    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` of them (0: all) as [n, V] float32
        on the CPU. Asking only for what is needed matters: a 1,000-token prefill of a 150k vocabulary is 600 MB.
        One position more than is new may be asked for: the last one fed, whose logits are kept (`LastLogits`)."""
        new = len(self.ids) - self.cached
        held = self.last.first_of(len(self.ids), keep) if keep == new + 1 else None
        if held is not None and new == 0:
            return held[None]
        if held is None and new == 0:  # nothing new and nothing kept: re-feed the last token to get its logits again
            self._rollback(1)
        t0 = time.perf_counter()
        fresh = torch.tensor([self.ids[self.cached :]], device=self.model.device)
        want = keep - (held is not None)
        out = self._run(fresh, want) if self.recurrent is None or self.cached == 0 else self._steps(fresh, want)
        self.fed_since_crop += len(self.ids) - self.cached
        self.cached = len(self.ids)
        logits = out[0].float().cpu()  # waits for the device, so the time below is the forward's
        self.forward_s += time.perf_counter() - t0
        self.last.keep(logits, len(self.ids))
        return torch.cat([held[None], logits]) if held is not None else logits

    def _steps(self, fresh: torch.Tensor, keep: int) -> torch.Tensor:
        """`fresh` fed a token per forward, as plain decoding feeds a model with recurrent layers (usd/recurrent.py),
        each after a snapshot of the states before it; the logits of the last `keep` (0: all)."""
        assert self.recurrent is not None
        rows = []
        for j in range(fresh.shape[1]):
            self.recurrent.take(self.cached + j)
            rows.append(self._run(fresh[:, j : j + 1], 1))
        out = torch.cat(rows, dim=1)
        return out[:, -keep:] if keep else out

    def _run(self, fresh: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward of the model over `fresh` ([1, n] ids) on this context's cache: the logits of its last `keep`
        positions (0: all), [1, n, V] on the model's device."""
        return self.model(input_ids=fresh, cache=self.cache, use_cache=True, logits_to_keep=keep).logits


def open_context(model, ids: list[int]):
    """A decoding context (ids, KV cache, `forward`, `truncate`) on whichever runner loaded the model: a model object
    that brings its own (`new_context`) gets that, a transformers model gets `Context`."""
    new_context = getattr(model, "new_context", None)
    return new_context(ids) if new_context is not None else Context(model, ids)


def bytes_of(tb: TokenizerBytes, i: int) -> bytes:
    b = tb.bytes_of.get(i)
    return b if b is not None else tb.specials.get(i, "").encode()


def model_vocab_size(model) -> int:
    """How many logits a model scores per position (its LM head's rows, which may exceed the tokenizer's vocabulary),
    on either runner: a transformers model's output embeddings, else its config's vocab_size (llama.cpp's)."""
    head = getattr(model, "get_output_embeddings", None)
    head = head() if head is not None else None
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def model_context_length(model) -> int | None:
    """The most positions a model's config says it takes (learned position tables end there), if it says."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        n = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


@dataclass
class Pair:
    """A loaded (target, drafter) pair with what the algorithms need to know about their vocabularies.

    `memory` outlives single generations: what `auto` has measured about this pair on this machine (cost per token
    of each algorithm, which drafter prompt rendering was accepted more).
    """

    target: Any
    target_tokenizer: Any
    drafter: Any | None = None
    drafter_tokenizer: Any | None = None
    target_name: str = "target"
    drafter_name: str | None = None
    context_length: int | None = None
    """The target's context in tokens (None: unchecked)."""
    drafter_context_length: int | None = None
    """The drafter's; None: what its config says (`model_context_length`)."""
    memory: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def same_tokenizer(self) -> bool:
        if self.drafter_tokenizer is None:
            return False
        if "same" not in self._cache:
            self._cache["same"] = same_vocabulary(self.target_tokenizer, self.drafter_tokenizer)
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
        """TLI's shared vocabulary I, built once per pair: (drafter ids in I, the target id of each, the target's
        vocabulary size). Several drafter ids may map to one target id."""
        if "map" not in self._cache:
            vocab_t, vocab_d = model_vocab_size(self.target), model_vocab_size(self.drafter)
            if self.same_tokenizer:
                d_ids = list(range(min(vocab_t, vocab_d)))
                t_ids = d_ids
            else:
                d2t = align(self.target_tokenizer, self.drafter_tokenizer).drafter_to_target
                pairs = [(d, t) for d, t in d2t.items() if d < vocab_d and t < vocab_t]  # in id order: align's
                d_ids, t_ids = [d for d, _ in pairs], [t for _, t in pairs]
            self._cache["map"] = (torch.tensor(d_ids, dtype=torch.long), torch.tensor(t_ids, dtype=torch.long), vocab_t)
        return self._cache["map"]

    def drafter_byte_ids(self) -> dict[int, int]:
        """byte value -> a drafter token of exactly that one byte (byte-level BPE's alphabet, SentencePiece's <0xNN>),
        so the drafter can be fed text that is not valid UTF-8."""
        if "byte_ids" not in self._cache:
            singles = {b[0]: i for i, b in sorted(self.drafter_bytes.bytes_of.items(), reverse=True) if len(b) == 1}
            self._cache["byte_ids"] = singles
        return self._cache["byte_ids"]

    def eos_ids(self) -> set[int]:
        ids = set(self.target_bytes.eos_ids)
        gen = getattr(self.target, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids
