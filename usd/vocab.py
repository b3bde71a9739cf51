"""Vocabularies compared as the raw bytes their tokens produce.

Tokenizers spell tokens in private alphabets: byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM) maps every byte to a
printable character (`Ġ` is a space, `Ċ` a newline), SentencePiece (Gemma, Llama-2) writes `▁` for a space and
`<0xNN>` for a fallback byte. Two tokenizers share a token when the bytes are the same, whatever the spelling; only
then can a drafter's token be verified as a target token. Special tokens (chat markers, end of sequence) are matched
by their literal string, and only when both sides have that string.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import weakref
from dataclasses import dataclass, field
from functools import lru_cache

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

CEILING_SAMPLE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]

Speculative decoding lets a small model propose several tokens that the large model then checks in one pass.
When the proposals are right, the answer arrives faster; when they are wrong, nothing is lost but a little time.
{"name": "Ada", "languages": ["en", "fr"], "score": 0.97}
'''
"""The text the alpha ceiling is measured on: code and prose, what users of a chat app paste."""


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def tokenizer_kind(tokenizer) -> str:
    """'byte_level' or 'sentencepiece' (▁ for spaces, <0xNN> byte fallback), judged from the decoder pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        # the lowest ids, not the first keys: get_vocab()'s order is not the id order and may change per process
        vocab = tokenizer.get_vocab()
        return "sentencepiece" if "▁" in "".join(sorted(vocab, key=vocab.get)[:2000]) else "byte_level"
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace", "Replace", "Strip", "Fuse"}:
        return "sentencepiece"
    model = spec.get("model") or {}
    return "sentencepiece" if model.get("byte_fallback") or model.get("type") == "Unigram" else "byte_level"


def piece_bytes(piece: str, kind: str) -> bytes | None:
    """The bytes a (non-special) token piece produces, or None if the piece is not expressible as bytes."""
    if kind == "byte_level":
        table = byte_decoder()
        try:
            return bytes(table[ch] for ch in piece)
        except KeyError:
            return None  # a character outside the byte alphabet: an added, non-byte token
    m = _BYTE_PIECE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


@dataclass
class TokenizerBytes:
    """One tokenizer's vocabulary split into byte-expressible tokens and special strings."""

    kind: str
    bytes_of: dict[int, bytes]
    """Token id -> the bytes it produces, for ordinary tokens."""
    specials: dict[int, str]
    """Token id -> literal string, for added/special tokens (chat markers, bos/eos, control tokens)."""
    eos_ids: set[int] = field(default_factory=set)
    size: int = 0


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> its TokenizerBytes: reading a real vocabulary takes a second or more, and every Pair around the same
tokenizer (a loaded model's, tests', usd suggest's) asks for it."""


def tokenizer_bytes(tokenizer) -> TokenizerBytes:
    """What each token of `tokenizer` produces, read once per tokenizer (again when its tokens or its end of
    sequence changed). The result is shared: read it, never change it."""
    try:
        known = _KNOWN.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: read it each time
        known = None
    if known is not None and known.size == len(tokenizer) and known.eos_ids == _eos_of(tokenizer):
        return known
    read = _read_tokenizer_bytes(tokenizer)
    with contextlib.suppress(TypeError):
        _KNOWN[tokenizer] = read
    return read


def _read_tokenizer_bytes(tokenizer) -> TokenizerBytes:
    kind = tokenizer_kind(tokenizer)
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    bytes_of: dict[int, bytes] = {}
    specials: dict[int, str] = dict(added)
    for piece, i in tokenizer.get_vocab().items():
        if i in added:
            continue
        b = piece_bytes(piece, kind)
        if b is None or b == b"":
            specials[i] = piece
        else:
            bytes_of[i] = b
    return TokenizerBytes(kind, bytes_of, specials, _eos_of(tokenizer), size=len(tokenizer))


def _eos_of(tokenizer) -> set[int]:
    eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@dataclass
class Overlap:
    """The shared vocabulary I of a target and a drafter, and maps between their ids."""

    target: TokenizerBytes
    drafter: TokenizerBytes
    drafter_to_target: dict[int, int]
    """Every drafter id in I -> the target id with the same bytes (several drafter ids may map to one target id), in
    drafter id order."""
    shared_strings: int
    """How many distinct byte strings (plus shared special strings) both vocabularies hold."""
    shared_without_normalisation: int
    """Tokens spelled identically in both vocabularies, private alphabets and all."""


def _canonical_ids(tb: TokenizerBytes, tokenizer) -> dict[bytes, int]:
    """byte string -> one target id. Where several ids spell the same bytes, prefer the one the tokenizer produces."""
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in tb.bytes_of.items():
        by_bytes.setdefault(b, []).append(i)
    out = {}
    for b, ids in by_bytes.items():
        if len(ids) > 1:
            try:
                enc = tokenizer.encode(b.decode("utf-8"), add_special_tokens=False)
            except UnicodeDecodeError:
                enc = []
            ids = [enc[0]] if len(enc) == 1 and enc[0] in ids else sorted(ids)
        out[b] = ids[0]
    return out


def align(target_tokenizer, drafter_tokenizer) -> Overlap:
    t, d = tokenizer_bytes(target_tokenizer), tokenizer_bytes(drafter_tokenizer)
    t_ids = _canonical_ids(t, target_tokenizer)
    d2t = {i: t_ids[b] for i, b in d.bytes_of.items() if b in t_ids}
    # Special tokens cross only by identical literal string (<|im_end|> in both ChatML models), and end of sequence
    # maps to end of sequence even when spelled differently, so a drafter that wants to stop can say so.
    t_special = {s: i for i, s in sorted(t.specials.items(), reverse=True)}
    shared_special = 0
    for i, s in d.specials.items():
        if s in t_special:
            d2t[i] = t_special[s]
            shared_special += 1
    t_eos = sorted(t.eos_ids)
    for i in d.eos_ids:
        if i not in d2t and t_eos:
            d2t[i] = t_eos[0]
    shared_bytes = len({b for b in d.bytes_of.values()} & set(t_ids))
    raw = set(target_tokenizer.get_vocab()) & set(drafter_tokenizer.get_vocab())
    # In drafter id order: get_vocab(), which the loops above follow, comes in an order the Rust tokenizers
    # randomise per process, and nothing downstream should see a different map in each run.
    return Overlap(t, d, dict(sorted(d2t.items())), shared_bytes + shared_special, len(raw))


def alpha_ceiling(target_tokenizer, overlap: Overlap, text: str = CEILING_SAMPLE) -> float:
    """The highest acceptance rate tli can reach on `text`: the share of the target's own tokens of it that the shared
    vocabulary holds. tli drafts only shared tokens, so where the target's tokenization steps outside them a draft
    must fail; slem drafts free text and is not bound by it."""
    return ceiling_of(target_tokenizer, set(overlap.drafter_to_target.values()), text)


def ceiling_of(target_tokenizer, shared_target_ids: set[int], text: str = CEILING_SAMPLE) -> float:
    """`alpha_ceiling` from the target ids the shared vocabulary holds (a loaded pair's `intersection`)."""
    ids = target_tokenizer.encode(text, add_special_tokens=False)
    return sum(i in shared_target_ids for i in ids) / len(ids)


def same_vocabulary(a, b) -> bool:
    """Both tokenizers map every piece to the same id: `standard` speculative decoding applies."""
    return a is b or a.get_vocab() == b.get_vocab()


def overlap_report(
    target_tokenizer,
    drafter_tokenizer,
    target_vocab: int | None = None,
    drafter_vocab: int | None = None,
    overlap: Overlap | None = None,
) -> dict:
    """The numbers `usd overlap` prints, tli's alpha ceiling on CEILING_SAMPLE among them. Vocabulary sizes default to
    the tokenizers' sizes; pass the models' embedding sizes (config.vocab_size) to report against the rows the model
    actually scores. Pass `overlap` when the caller has aligned the two already (it takes a second or two for 150k
    vocabularies)."""
    o = overlap or align(target_tokenizer, drafter_tokenizer)
    tv = target_vocab or o.target.size
    dv = drafter_vocab or o.drafter.size
    return {
        "target_vocab": tv,
        "drafter_vocab": dv,
        "shared": o.shared_strings,
        "shared_pct_target": round(100 * o.shared_strings / tv, 2),
        "shared_pct_drafter": round(100 * o.shared_strings / dv, 2),
        "shared_without_normalisation": o.shared_without_normalisation,
        "target_tokenizer": o.target.kind,
        "drafter_tokenizer": o.drafter.kind,
        "alpha_ceiling_tli": alpha_ceiling(target_tokenizer, o),
    }


def fingerprint(token_bytes: TokenizerBytes) -> str:
    """A fingerprint of a tokenizer's vocabulary, its tokens' bytes and specials: what is remembered in one's ids
    (usd/suffix.py) never serves another."""
    h = hashlib.sha256()
    for i, b in sorted(token_bytes.bytes_of.items()):
        h.update(i.to_bytes(4, "little") + len(b).to_bytes(2, "little") + b)
    for i, s in sorted(token_bytes.specials.items()):
        h.update(i.to_bytes(4, "little") + s.encode())
    return h.hexdigest()[:16]
