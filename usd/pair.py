"""A loaded (target, drafter) pair: the models, their runners and tokenizers, and what the algorithms need to know
about their vocabularies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .memory import PairMemory
from .runners import Runner, cpu_threads, runner_for
from .vocab import Overlap, TokenizerBytes, align, fingerprint, same_vocabulary, tokenizer_bytes


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
    memory: PairMemory = field(default_factory=PairMemory, repr=False)
    target_runner: Runner = field(default=None, repr=False)  # type: ignore[assignment]
    """What opens the target's decoding contexts (given at load; by default the one `runners.runner_for` gives)."""
    drafter_runner: Runner | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.target_runner is None:
            self.target_runner = runner_for(self.target)
        if self.drafter_runner is None and self.drafter is not None:
            self.drafter_runner = runner_for(self.drafter)

    def fills_cpu(self) -> bool:
        """Whether the target computes on this machine's CPU with a thread on every core this process may use: then
        any other work here (a page update) displaces one of its threads."""
        threads = self.target_runner.cpu_threads()
        return threads is not None and threads >= cpu_threads()

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
    def tokenizer_key(self) -> str:
        """A fingerprint of the target's vocabulary: what its remembered answers are kept under (usd/suffix.py)."""
        if "tokenizer_key" not in self._cache:
            self._cache["tokenizer_key"] = fingerprint(self.target_bytes)
        return self._cache["tokenizer_key"]

    @property
    def drafter_bytes(self) -> TokenizerBytes:
        if "db" not in self._cache:
            self._cache["db"] = tokenizer_bytes(self.drafter_tokenizer)
        return self._cache["db"]

    def overlap(self) -> Overlap:
        """The two vocabularies aligned, once per pair (a second or so for 150k tokens): what tli's map and the Pair
        tab's overlap line are made of."""
        if "overlap" not in self._cache:
            self._cache["overlap"] = align(self.target_tokenizer, self.drafter_tokenizer)
        return self._cache["overlap"]

    def intersection(self):
        """TLI's shared vocabulary I, built once per pair: (drafter ids in I, the target id of each, the target's
        vocabulary size). Several drafter ids may map to one target id."""
        if "map" not in self._cache:
            vocab_t, vocab_d = model_vocab_size(self.target), model_vocab_size(self.drafter)
            if self.same_tokenizer:
                d_ids = list(range(min(vocab_t, vocab_d)))
                t_ids = d_ids
            else:
                d2t = self.overlap().drafter_to_target
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
