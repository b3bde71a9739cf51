"""Vocabulary alignment on the tokenizers built in tests/tiny_tokenizers.py (the fast tier's stand-ins for Qwen,
SmolLM2 and Gemma; tests/test_overlap.py checks the real ones): byte-level against byte-level with other merges,
and byte-level against SentencePiece with byte fallback."""

from __future__ import annotations

import pytest
import tiny_tokenizers as tiny

from usd.pair import Pair
from usd.vocab import align, overlap_report, same_vocabulary, tokenizer_bytes, tokenizer_kind

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFTERS = {"byte-level": tiny.drafter_byte_level, "sentencepiece": tiny.drafter_sentencepiece}


def test_kinds_and_what_was_built():
    t, b, s = tiny.target(), tiny.drafter_byte_level(), tiny.drafter_sentencepiece()
    assert (tokenizer_kind(t), tokenizer_kind(b), tokenizer_kind(s)) == ("byte_level", "byte_level", "sentencepiece")
    assert t.eos_token == b.eos_token == "<|im_end|>" and s.eos_token == "<eos>"
    assert len({len(t), len(b), len(s)}) == 3 and all(300 < len(x) < 700 for x in (t, b, s))
    assert not same_vocabulary(t, b) and same_vocabulary(t, tiny.target())
    # SentencePiece's layout: <bos> first in every encoding, and bytes it has no piece for spelled <0xNN>
    ids = s.encode("ok 🌟")
    assert ids[0] == s.bos_token_id and "<0xF0>" in s.convert_ids_to_tokens(ids)
    for tok in (t, b, s):
        for text in ["def fibonacci(n):", "日本の首都は 🌟 Ω", "Écrivez  une\n\tphrase"]:
            assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_every_shared_token_maps_to_a_target_token_with_the_same_bytes(drafter):
    t, d = tiny.target(), DRAFTERS[drafter]()
    o = align(t, d)
    tb, db = tokenizer_bytes(t), tokenizer_bytes(d)
    ordinary = {i: j for i, j in o.drafter_to_target.items() if i in db.bytes_of}
    assert ordinary and all(db.bytes_of[i] == tb.bytes_of[j] for i, j in ordinary.items())
    # every byte string both vocabularies hold is in the map, and nothing else
    shared = set(db.bytes_of.values()) & set(tb.bytes_of.values())
    assert {db.bytes_of[i] for i in ordinary} == shared and o.shared_strings >= len(shared)
    # each of the 256 bytes is a token on both sides (byte-level's alphabet, SentencePiece's <0xNN>)
    singles = {b for b in shared if len(b) == 1}
    assert singles == {bytes([x]) for x in range(256)}
    # the drafter's eos is the target's eos; special tokens cross only by identical strings
    assert o.drafter_to_target[d.eos_token_id] == t.eos_token_id
    specials = {i: j for i, j in o.drafter_to_target.items() if i in db.specials and i != d.eos_token_id}
    assert all(db.specials[i] == tb.specials[j] for i, j in specials.items())
    if drafter == "sentencepiece":
        assert d.bos_token_id not in o.drafter_to_target  # the target has no <bos>
        assert 0.5 < len(shared) / len(db.bytes_of) < 1  # tokens on both sides, and tokens only the drafter has
    else:
        assert {db.specials[i] for i in specials} == {"<|endoftext|>", "<|im_start|>"}
        assert len(shared) < min(len(db.bytes_of), len(tb.bytes_of))  # each has tokens the other lacks
    assert list(o.drafter_to_target) == sorted(o.drafter_to_target)  # id order: the same map in every process


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_overlap_report_and_the_pairs_intersection_agree(drafter):
    from tiny_pairs import tiny_pair

    t, d = tiny.target(), DRAFTERS[drafter]()
    report = overlap_report(t, d)
    assert report["target_vocab"] == len(t) and report["drafter_vocab"] == len(d)
    assert report["drafter_tokenizer"] == tokenizer_kind(d) and 0 < report["shared_pct_target"] < 100
    target, model = tiny_pair(t, d)
    d_ids, t_ids, vocab_t = Pair(target, t, model, d).intersection()
    assert vocab_t == len(t) and dict(zip(d_ids.tolist(), t_ids.tolist(), strict=True)) == align(t, d).drafter_to_target
