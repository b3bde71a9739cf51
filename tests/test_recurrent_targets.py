"""Targets whose layers keep a recurrent state (Mamba, and hybrids of attention and state-space layers such as Jamba)
on the transformers runner. Their state cannot be cropped back like a KV cache, so a rejected draft must not stay in
it: a context rolled back past a verify goes on with the logits a context fed only plain steps computes, and greedy
speculative decoding equals plain decoding. Tiny random models built from configs (no download), over the fast
tier's tokenizers.
"""

from __future__ import annotations

import warnings

import pytest
import tiny_tokenizers as tiny
import torch
from tiny_pairs import how, tiny_config

from usd.decoder import stream
from usd.pair import Pair
from usd.runners import runner_for

pytestmark = pytest.mark.usefixtures("one_thread")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


def tiny_mamba(tokenizer):
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return MambaForCausalLM(config)


def tiny_jamba(tokenizer):
    """Attention and Mamba layers alternating (two of each), one expert."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=100,
        num_experts=1,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=4,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return JambaForCausalLM(config)


BUILDERS = {"mamba": (tiny_mamba, 3.0), "jamba": (tiny_jamba, 10.0)}
"""Each builder, and the gain on its state-space layers' projections that makes their state matter: with random
weights at their initial scale the recurrent state moves the logits by 1e-4 to 1e-2, too little for a greedy answer
to show a stale state."""


@torch.no_grad()
def sharpened(model, seed: int, state_gain: float = 1.0):
    """Random weights, with a few dozen tokens carrying most of the mass (as tiny_pairs does): greedy answers have
    wide margins and say real tokens, not one id over and over."""
    for name, weight in model.named_parameters():
        if name.rsplit(".", 2)[-2] in ("in_proj", "x_proj", "out_proj") and ("mamba" in name or "mixer" in name):
            weight.mul_(state_gain)
    torch.manual_seed(seed)
    head = model.get_output_embeddings().weight
    head[torch.randperm(head.shape[0])[:48]] *= 30.0
    return model.eval()


@pytest.fixture(scope="module", params=list(BUILDERS))
def recurrent(request):
    tok = tiny.target()
    build, gain = BUILDERS[request.param]
    torch.manual_seed(0)
    return request.param, sharpened(build(tok), 0, gain), tok


def test_a_context_rolled_back_past_a_verify_equals_a_fresh_evaluation(recurrent):
    """Feed 1..5, verify 6, 7, 8 in one forward, cut back to 1..6, append 9: the logits equal those of 1..6, 9
    evaluated from nothing (the rejected 7 and 8 must not stay in the recurrent state)."""
    name, model, _ = recurrent
    ids = [11, 12, 13, 14, 15, 16, 17, 18]
    ctx = runner_for(model).new_context(ids[:5])
    ctx.forward(keep=1)
    ctx.ids.extend(ids[5:])
    ctx.forward(keep=4)
    ctx.truncate(6)
    ctx.ids.append(19)
    rolled = ctx.forward(keep=1)
    with torch.no_grad():
        fresh = model(torch.tensor([[*ids[:6], 19]])).logits[0, -1:]
    gap = float((rolled - fresh).abs().max())
    assert gap < 1e-4, f"{name}: {gap:.3g} logits apart"


def test_greedy_tli_equals_plain_decoding(recurrent):
    name, target, tok = recurrent
    drafter_tok = tiny.drafter_byte_level()
    torch.manual_seed(1)
    drafter = sharpened(__import__("transformers").LlamaForCausalLM(tiny_config(drafter_tok)), 1)
    pair = Pair(target, tok, drafter, drafter_tok, f"tiny-{name}", "tiny-llama")
    for prompt in ("def fibonacci(n):", "The capital of France is", "Count: one two three"):
        ids, dids = tok.encode(prompt), drafter_tok.encode(prompt)
        *_, plain = stream(pair, ids, dids, how(algorithm="none", max_new_tokens=24))
        *_, done = stream(pair, ids, dids, how(algorithm="tli", k=4, max_new_tokens=24), probe_first=False)
        assert done.target_ids == plain.target_ids, f"{name} on {prompt!r}"
        assert done.stats.drafted > done.stats.accepted, "the test needs rejected drafts, to roll back"
