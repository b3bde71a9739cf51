#!/usr/bin/env python
"""GPU check for the loading code: a random-weight Llama (hidden size 256) built from config, loaded 4-bit NF4 and
8-bit through `usd.loading.load_model` on the GPU, 16 generated tokens each, and the memory used.

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
            lm = load_model(entry, device=device, precision=precision, log=lambda m: None)
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
            if device == "cuda":
                row["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            rows.append(row)
            del lm
    return rows


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
