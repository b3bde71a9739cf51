#!/usr/bin/env python
"""GPU check for the loading code: a random-weight Llama (hidden size 256) built from config, loaded 4-bit NF4 and 8-bit
through `usd.loading.load_model` on the GPU, 16 generated tokens each, and the memory used; then, on the decoding steps
the load chose (usd/runners/transformers/steps.py: on a GPU it times transformers' cache, a static one and a compiled
step), 32 tokens of our plain decoding against `standard` speculation with the model as its own drafter. Random weights
make near-ties likely, so a difference is reported with its gap (usd.numerics), not asserted.

    python scripts/gpu_check_quantized.py                      # on a CUDA machine: nf4, int8, bf16
    python scripts/gpu_check_quantized.py --device cpu --precisions fp32   # the same path on a CPU (the test runs it)

Weights are random (their values do not matter for loading or memory) and the tokenizer is a 256-symbol byte-level
one built here, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def build_tiny_llama(directory: Path, hidden_size: int = 256, layers: int = 4) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    eos = len(vocab) - 1
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos,
        bos_token_id=eos,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def run(device: str, precisions: list[str]) -> list[dict]:
    import torch

    from usd.loading import entry_for, load_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        entry = entry_for(str(build_tiny_llama(Path(tmp))))
        for precision in precisions:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            said: list[str] = []
            lm = load_model(entry, device=device, precision=precision, log=said.append)
            ids = lm.tokenizer("speculative decoding", return_tensors="pt").to(lm.model.device)
            t0 = time.perf_counter()
            out = lm.model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            seconds = time.perf_counter() - t0
            row = {
                "precision": precision,
                "loaded_as": lm.plan.precision,
                "why": lm.plan.note,
                "device": str(lm.model.device),
                "new_tokens": int(out.shape[1] - ids["input_ids"].shape[1]),
                "weights_bytes": int(lm.model.get_memory_footprint()),
                "linear_weight_dtype": str(lm.model.model.layers[0].mlp.up_proj.weight.dtype),
                "generate_s": round(seconds, 3),
                "estimate_bytes": lm.plan.estimate_bytes,
            }
            row["load_said"] = [line for line in said if "decoding steps" in line]  # the steps chosen, and why
            row.update(speculation_check(lm))
            if device == "cuda":
                row["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            rows.append(row)
            del lm
    return rows


def speculation_check(lm) -> dict:
    """Our loop on the loaded model: plain greedy and `standard` speculation (the model drafts for itself), timed."""
    from usd.decoder import stream
    from usd.numerics import divergence
    from usd.pair import Pair
    from usd.settings import GenerationSettings

    pair = Pair(lm.model, lm.tokenizer, lm.model, lm.tokenizer, "check", "check")
    ids = lm.tokenizer.encode("speculative decoding is")
    answers, seconds = {}, {}
    for algorithm, k in (("none", None), ("standard", 4)):
        t0 = time.perf_counter()
        *_, done = stream(
            pair,
            ids,
            ids,
            GenerationSettings(algorithm=algorithm, draft_tokens=k, max_new_tokens=32),
            probe_first=False,
        )
        seconds[algorithm], answers[algorithm] = round(time.perf_counter() - t0, 3), list(done.target_ids)
    plain, spec = answers["none"], answers["standard"]
    row = {
        "decoding_steps": getattr(lm.runner, "steps", "gguf"),
        "loop_s": seconds,
        "standard_equals_plain": spec == plain,
    }
    if spec != plain:
        first = next(
            (i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b), min(len(plain), len(spec))
        )
        row["first_difference"] = divergence(pair, ids, plain, first).explain()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="nf4,int8,bf16")
    args = parser.parse_args()
    rows = run(args.device, args.precisions.split(","))
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r["new_tokens"] == 16 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
