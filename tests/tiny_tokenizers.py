"""Small tokenizers built in the tests, so the engine can be tested without pulling a model (the fast tier).

Three tokenizers of the two kinds the real models have, trained here on one small text in well under a second:
- `byte_level(merges)`: byte-level BPE as Qwen and SmolLM2 have it (the 256-byte alphabet, `Ġ` for a space), with
  ChatML's specials; `<|im_end|>` is end of sequence.
- two of them with different merge counts (and so different vocabularies and tokenizations of the same text), like
  a Qwen target with a SmolLM2 drafter: they share the byte alphabet, the specials and many merged tokens;
- `sentencepiece()`: SentencePiece-style BPE with byte fallback as Gemma has it (`▁` for a space, `<0xNN>` for a byte
  its vocabulary lacks, `<bos>` before every prompt, `<eos>` to end): a different alphabet, so the shared vocabulary
  with a byte-level target is found through the bytes tokens produce (usd.vocab), and characters outside its
  training text (the emoji, most CJK) are spelled byte by byte.

Training is deterministic, so every process builds the same vocabularies (tiny_pairs.tiny_pair relies on that).
Vocabularies are a few hundred tokens: tiny random models over them run a generation in milliseconds.
"""

from __future__ import annotations

import json
from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Code, prose, a little French, one CJK phrase and one emoji: merges for all of them, and multi-byte characters
# split across tokens. Prompts in the tests that use other characters exercise byte fallback and bare-byte tokens.
TEXT = """\
def add(a, b):
    return a + b


def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()


for i in range(10):
    print(i, add(i, i))

The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
Speculative decoding drafts tokens with a small model and verifies them with the large one.
The output is exactly the output of the large model: greedy or sampled, nothing changes.
One, two, three, four, five, six, seven, eight, nine, ten.
Count: one two three four five. Count again: one two three.
Écrivez une phrase en français : le café est très bon, merci beaucoup.
日本の首都は東京です。
Emoji party: 🎉🎉 and more 🎉 here.
"""

# The byte-level drafter learns on this text as well: its vocabulary then holds tokens the target's lacks (and lacks
# many of the target's), as two real model families' vocabularies do.
MORE_TEXT = """\
{"name": "Ada", "languages": ["Python", "C"], "year": 1843}
| a | b |
|---|---|
| 1 | 2 |
The quick brown fox jumps over the lazy dog; the dog sleeps, the fox runs away.
x = [1, 2, 3]
y = {"key": "value", "other": [x, x]}
"""

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SP_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def _wrap(raw: Tokenizer, **special) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False, **special)
    tok.model_max_length = 4096
    return tok


@cache
def byte_level(merges: int = 300, text: str = TEXT) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `merges` merges learnt on `text`: 256 byte tokens, then the merges, then ChatML's specials
    (added tokens, as in Qwen). eos = <|im_end|>. No bos, like Qwen."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    raw.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    raw.add_special_tokens(CHATML)
    return _wrap(raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@cache
def sentencepiece(merges: int = 200, text: str = TEXT) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE with byte fallback (Gemma's layout): ids 0-3 <pad> <eos> <bos> <unk>, then the 256
    `<0xNN>` byte pieces, then the characters and merges learnt on `text`, spaces written `▁`. Encoding adds <bos>."""
    normalizer = normalizers.Replace(" ", "▁")
    # Learn the pieces on the normalised text; only the characters of the text's first lines make the alphabet (no
    # CJK, no emoji), so those are spelled with byte pieces.
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizer
    learner.pre_tokenizer = pre_tokenizers.Split(Regex(r"▁?[^▁]+|▁+"), behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=10_000, limit_alphabet=80, min_frequency=2, show_progress=False, special_tokens=[]
    )
    learner.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    spec = json.loads(learner.to_str())["model"]  # merges in the order learnt: keep the first `merges`
    pieces = sorted(spec["vocab"], key=spec["vocab"].get)
    kept_merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"][:merges]]
    merged = {a + b for a, b in kept_merges}
    alphabet = [p for p in pieces if len(p) == 1]
    vocab = {s: i for i, s in enumerate(SP_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in alphabet + [p for p in pieces if p in merged]:
        vocab.setdefault(p, len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=kept_merges, unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizer
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"▁?[^▁]+|▁+"), behavior="isolated")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    raw.add_special_tokens(SP_SPECIALS)
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return _wrap(raw, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")


def target() -> PreTrainedTokenizerFast:
    """The target's tokenizer in the fast tier's pairs: byte-level, 300 merges."""
    return byte_level(300)


def drafter_byte_level() -> PreTrainedTokenizerFast:
    """A byte-level drafter whose vocabulary differs from the target's (like SmolLM2 for Qwen): 200 merges learnt on
    the target's text and some more."""
    return byte_level(200, TEXT + MORE_TEXT)


def drafter_sentencepiece() -> PreTrainedTokenizerFast:
    """A SentencePiece drafter with byte fallback (like Gemma for SmolLM2)."""
    return sentencepiece()
