"""Point 5 of the hardening issue: a greedy difference is explained as a near-tie (rounding) or flagged as a defect,
and `usd bench` reports the identity rate for the precision it ran."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app import render
from usd.bench.report import table
from usd.bench.run import Run, summarize
from usd.events import Finished, Stats
from usd.numerics import divergence
from usd.pair import Pair

PROMPT = [3, 4, 5]


@torch.no_grad()
def _target(second_logit_share: float) -> LlamaForCausalLM:
    """A tiny model whose top two tokens after PROMPT (ids 7 and 9) have logits L and share * L."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    h = model.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0, -1]
    unit = h / h.norm() ** 2  # logit of a row r * unit is r
    model.lm_head.weight.zero_()
    model.lm_head.weight[7] = 20.0 * unit
    model.lm_head.weight[9] = 20.0 * second_logit_share * unit
    return model


def test_a_tie_within_rounding_is_a_near_tie_and_a_clear_gap_is_not():
    tie = divergence(Pair(_target(1.0 - 1e-7), None), PROMPT, [], 0)
    assert tie.near_tie and tie.gap < 1e-4 and "near-tie" in tie.explain() and tie.dtype == "float32"
    gap = divergence(Pair(_target(0.5), None), PROMPT, [], 0)
    assert not gap.near_tie and abs(gap.gap - 10.0) < 1e-3 and "defect" in gap.explain()


def test_bf16_rounding_is_wider_than_float32():
    model = _target(0.99).to(torch.bfloat16)
    d = divergence(Pair(model, None), PROMPT, [], 0)
    assert d.dtype == "bfloat16" and d.tolerance > 0.2 and d.near_tie  # 0.2 logits apart at 20: bf16 rounding


def _finished(ids, wall_s=1.0, algorithm="tli"):
    return Finished("t", tuple(ids), Stats(algorithm, 3, 4, 2, len(ids), wall_s, "eos", 0.3, 1.2, 2.0))


def test_compare_says_whether_a_greedy_difference_was_a_near_tie():
    plain, spec = _finished([1, 2, 3], algorithm="none"), _finished([1, 5, 3])
    tie = divergence(Pair(_target(1.0), None), PROMPT, [], 0)
    s = render.compare_summary(plain, spec, True, tie)
    assert s["near_tie"] is True and s["logit_gap"] == tie.gap
    html = render.summary_html(s)
    assert "near-tie" in html and "compare-differ-ok" in html
    s = render.compare_summary(plain, spec, True, divergence(Pair(_target(0.5), None), PROMPT, [], 0))
    assert s["near_tie"] is False and "defect" in render.summary_html(s)


def _run(prompt, algorithm, ids):
    return Run(prompt, algorithm, 0 if algorithm == "none" else 4, ids, 1.0, len(ids), 2, 3, 2, 3.0, 0.3, 1.2, 0.9)


def test_bench_reports_the_identity_rate_and_the_precision():
    runs = [_run("a", "none", [1, 2]), _run("b", "none", [3, 4]), _run("a", "tli", [1, 2]), _run("b", "tli", [3, 9])]
    rows = {r["algorithm"]: r for r in summarize(runs, [("none", 0), ("tli", 4)], greedy=True)}
    assert rows["tli"]["identical_rate"] == 0.5 and rows["tli"]["identical_to_none"] is False
    assert rows["none"]["identical_rate"] == 1.0
    text = table(list(rows.values()), "bfloat16")
    assert "identical (bfloat16)" in text and "NO: 50%" in text
