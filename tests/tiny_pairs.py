"""Tiny random target/drafter pairs that use the real tokenizers, fast enough for thousands of samples.

The drafter shares the target's transformer body and copies the target's embedding and LM-head rows for every token
in the shared vocabulary (plus noise), so its proposals overlap the target's without being equal: both the accept and
the reject paths of every rule get exercised.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from usd.vocab import align


def tiny_config(tokenizer) -> LlamaConfig:
    # eos as the tokenizer says (LlamaConfig's default id 2 is an ordinary token in most vocabularies)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=None,
    )


@torch.no_grad()
def tiny_pair(
    target_tokenizer,
    drafter_tokenizer,
    seed: int = 0,
    sharpness: float = 60.0,
    noise: float = 0.15,
    attention: float = 0.05,
):
    """`attention` scales the attention output. Weak attention (the default) makes the next token depend mostly on the
    last one (a near-bigram model), so two tokenizations of the same text lead both models to similar distributions,
    as real models of one language do; but then a cache that holds a wrong row barely changes a logit. At 1.0 the
    whole context matters, as greedy identity tests need (a stale row must change the answer)."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config(target_tokenizer)).eval()
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.mul_(attention)
    drafter = LlamaForCausalLM(tiny_config(drafter_tokenizer)).eval()
    drafter.model.layers.load_state_dict(target.model.layers.state_dict())
    drafter.model.norm.load_state_dict(target.model.norm.state_dict())
    if drafter_tokenizer is target_tokenizer:
        d_ids = t_ids = torch.arange(len(target_tokenizer))
    else:
        # The likely tokens below are drawn by position in this map: align() keeps it in id order, so every process
        # builds the same pair.
        d2t = align(target_tokenizer, drafter_tokenizer).drafter_to_target
        d_ids, t_ids = torch.tensor(list(d2t)), torch.tensor(list(d2t.values()))
    # A few dozen "likely" tokens, mostly shared ones plus some the drafter cannot spell, carry nearly all the mass.
    likely = torch.cat([t_ids[torch.randperm(len(t_ids))[:48]], torch.randint(len(target_tokenizer), (16,))])
    target.lm_head.weight[likely] *= sharpness
    drafter.model.embed_tokens.weight[d_ids] = target.model.embed_tokens.weight[t_ids]
    drafter.lm_head.weight[d_ids] = target.lm_head.weight[t_ids]
    # Noise relative to each copied row's scale: absolute noise on every row would, in a 262k vocabulary (Gemma),
    # lift thousands of unlikely drafter tokens to the level of the likely ones and leave alpha near zero.
    rows = drafter.lm_head.weight[d_ids]
    drafter.lm_head.weight[d_ids] = rows + noise * rows.std(dim=1, keepdim=True) * torch.randn_like(rows)
    return target, drafter


def how(algorithm="auto", k="auto", params=None, max_new_tokens=128, stop_strings=()):
    """The decode loop's settings (`decoder.stream`) in the tests' terms: a draft length `k` and a SamplingParams."""
    from usd.sampling import SamplingParams
    from usd.settings import GenerationSettings

    p = params or SamplingParams()
    return GenerationSettings(
        algorithm=algorithm,
        draft_tokens=k,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        max_new_tokens=max_new_tokens,
        stop_strings=stop_strings,
    )
