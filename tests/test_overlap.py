"""Vocabulary overlap as raw bytes, against the figures measured with the real tokenizers (README's table)."""

from __future__ import annotations

import json

import pytest

from usd.cli import main
from usd.vocab import CEILING_SAMPLE, align, byte_decoder, overlap_report, piece_bytes, tokenizer_kind

SMOL, QWEN, GEMMA = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"
VOCAB = {SMOL: 49152, QWEN: 151936, GEMMA: 262144}


def test_byte_decoder_is_a_bijection_on_bytes():
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["a"] == ord("a")


def test_piece_bytes_both_alphabets():
    assert piece_bytes("Ġhello", "byte_level") == b" hello"
    assert piece_bytes("Ã©", "byte_level") == "é".encode()
    assert piece_bytes("<|im_end|>", "byte_level") is not None  # plain ASCII: callers keep specials apart
    assert piece_bytes("▁hello", "sentencepiece") == b" hello"
    assert piece_bytes("<0x0A>", "sentencepiece") == b"\n"
    assert piece_bytes("<0xE2>", "sentencepiece") == b"\xe2"
    assert piece_bytes("é", "sentencepiece") == b"\xc3\xa9"


@pytest.mark.real_models
def test_tokenizer_kinds(real_tokenizers):
    assert tokenizer_kind(real_tokenizers[SMOL]) == "byte_level"
    assert tokenizer_kind(real_tokenizers[QWEN]) == "byte_level"
    assert tokenizer_kind(real_tokenizers[GEMMA]) == "sentencepiece"


# (target, drafter) -> shared, shared without normalisation, tli's alpha ceiling (shared / all of the target's tokens
# of CEILING_SAMPLE): counts, so exact; README's `usd overlap` table shows the same numbers
EXPECTED = {
    (QWEN, SMOL): (39_237, 39_237, (104, 122)),
    (SMOL, GEMMA): (46_138, 14_837, (131, 136)),
    (QWEN, GEMMA): (95_934, 24_520, (107, 122)),
}


@pytest.mark.real_models
@pytest.mark.parametrize(("target", "drafter"), list(EXPECTED))
def test_overlap_matches_the_measured_figures(target, drafter, real_tokenizers):
    report = overlap_report(real_tokenizers[target], real_tokenizers[drafter], VOCAB[target], VOCAB[drafter])
    shared, raw, (spelled, tokens) = EXPECTED[(target, drafter)]
    assert report["shared"] == shared
    assert report["shared_without_normalisation"] == raw
    assert len(real_tokenizers[target].encode(CEILING_SAMPLE, add_special_tokens=False)) == tokens
    assert report["alpha_ceiling_tli"] == spelled / tokens
    assert report["shared_pct_target"] == pytest.approx(100 * report["shared"] / VOCAB[target], abs=0.01)
    # symmetric: swapping roles shares the same strings
    swapped = overlap_report(real_tokenizers[drafter], real_tokenizers[target])
    assert swapped["shared"] == report["shared"]


@pytest.mark.real_models
def test_smol_qwen_percentages(real_tokenizers):
    r = overlap_report(real_tokenizers[QWEN], real_tokenizers[SMOL], VOCAB[QWEN], VOCAB[SMOL])
    assert r["shared_pct_drafter"] == 79.83  # 39,237 / 49,152, rounded to two places
    assert r["shared_pct_target"] == 25.82  # 39,237 / 151,936


@pytest.mark.real_models
def test_alignment_maps_bytes_specials_and_eos(real_tokenizers):
    qwen, smol, gemma = real_tokenizers[QWEN], real_tokenizers[SMOL], real_tokenizers[GEMMA]
    o = align(qwen, smol)
    # <|im_end|> is a special string in both: mapped on purpose, and it is each side's end of sequence
    assert o.drafter_to_target[smol.convert_tokens_to_ids("<|im_end|>")] == qwen.convert_tokens_to_ids("<|im_end|>")
    # an ordinary word maps to the target id that spells the same bytes
    d = smol.encode(" hello", add_special_tokens=False)
    t = qwen.encode(" hello", add_special_tokens=False)
    assert len(d) == len(t) == 1 and o.drafter_to_target[d[0]] == t[0]
    # across alphabets: Gemma's '▁hello' is SmolLM2's 'Ġhello'; Gemma's <eos> maps to SmolLM2's end of sequence
    g = align(smol, gemma)
    gid = gemma.convert_tokens_to_ids("▁hello")
    assert g.drafter_to_target[gid] == d[0]
    assert g.drafter_to_target[gemma.eos_token_id] == smol.eos_token_id
    # a byte-fallback token maps to the byte-level token for that byte
    assert g.drafter_to_target[gemma.convert_tokens_to_ids("<0x0A>")] == smol.convert_tokens_to_ids("Ċ")


@pytest.mark.real_models
def test_alignment_is_in_id_order(real_tokenizers):
    # get_vocab()'s order changes from process to process; the map must not (the tiny test pairs are drawn from it)
    for target, drafter in [(QWEN, SMOL), (SMOL, GEMMA)]:
        ids = list(align(real_tokenizers[target], real_tokenizers[drafter]).drafter_to_target)
        assert ids == sorted(ids)


@pytest.mark.real_models
def test_cli_overlap_json(real_paths, capsys):
    assert main(["overlap", QWEN, SMOL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    keys = {
        "target_vocab",
        "drafter_vocab",
        "shared",
        "shared_pct_target",
        "shared_pct_drafter",
        "shared_without_normalisation",
        "alpha_ceiling_tli",
    }
    assert keys <= set(report)
    assert report["target_vocab"] == VOCAB[QWEN] and report["drafter_vocab"] == VOCAB[SMOL]
    assert report["shared"] == 39_237
    assert report["alpha_ceiling_tli"] == 104 / 122


@pytest.mark.real_models
def test_cli_overlap_prints_the_alpha_ceiling(real_paths, capsys):
    assert main(["overlap", QWEN, GEMMA]) == 0
    out = capsys.readouterr().out
    assert "shared (as raw bytes): 95,934  = 63.1% of the target's, 36.6% of the drafter's vocabulary" in out
    assert "alpha ceiling for tli: 88% (the share of the target's tokens" in out
