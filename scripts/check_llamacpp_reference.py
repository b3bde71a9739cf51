"""Our plain greedy decoding on the llama.cpp runner against llama-cpp-python's own generate of the same GGUF, with
llama.cpp's default matmul kernels in both (repacked weights, the tiled matmul) and, given to `Llama`, the attention
settings our runner needs (flash attention, f16 K and bf16 V cache): the tokens must be the same, since our runner reads
a prompt in one batch and then a token at a time, as llama.cpp's generate does (usd/runners/llamacpp/kernels.py). This
checks the runner's loop, cache and kernel layout against llama.cpp's own. `--plain-weights` checks the other weight
layout (both sides without repacking). Our prompts are read on the same kernels as llama.cpp's here, not by a twin on
AMX tiles (USD_AMX_PREFILL=0; tests/test_llamacpp.py compares a twin's prompts with llama.cpp's own AMX kernels).

llama.cpp's default attention (no flash attention, an f16 cache) computes a prompt's attention with a batched kernel
and one token's with another; a batch-invariant runner cannot reproduce both, so `usd bench`'s `llamacpp` row (the
defaults, as a user opens the file) may differ from our tokens at near-ties.

    PYTHONPATH=. python scripts/check_llamacpp_reference.py [humaneval|mtbench] [N] [--plain-weights]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["USD_AMX_PREFILL"] = "0"  # before the library loads: our prompts on llama.cpp's default kernels too

import llama_cpp
import llama_cpp.llama_cpp as low_level

import usd
from usd import decoder
from usd.bench.run import _ids, forget_caches
from usd.datasets import load_prompts
from usd.runners import llamacpp
from usd.settings import GenerationSettings

MAX_NEW = 64


def reference_with_our_attention(model: llamacpp.LlamaCppModel, repacked: bool) -> llama_cpp.Llama:
    default_params = low_level.llama_model_default_params

    def with_our_layout():
        params = default_params()
        params.use_extra_bufts = repacked
        return params

    low_level.llama_model_default_params = with_our_layout  # Llama() has no argument for it
    try:
        return llamacpp.llama_with_our_attention(model)
    finally:
        low_level.llama_model_default_params = default_params


def main(dataset: str, n: int, repacked: bool) -> int:
    pair = usd.load_pair(precision="gguf", log=lambda m: None)
    if not repacked:
        loaded = pair.target
        pair.target = llamacpp.LlamaCppModel(
            loaded.path, n_ctx=loaded.n_ctx, name=loaded.name_or_path, repacked_weights=False
        )
        pair.target.generation_config = loaded.generation_config
        pair.target_runner = pair.target
    llm = reference_with_our_attention(pair.target, repacked)
    eos = pair.eos_ids()
    same = 0
    prompts = load_prompts(dataset, n)
    for prompt in prompts:
        t_ids, d_ids = _ids(pair, prompt)
        forget_caches(pair)
        *_, done = decoder.stream(pair, t_ids, d_ids, GenerationSettings(algorithm="none", max_new_tokens=MAX_NEW))
        ours = list(done.target_ids)
        llm.reset()
        theirs: list[int] = []
        for token in llm.generate(t_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if token in eos or len(theirs) >= MAX_NEW:
                break
            theirs.append(token)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        ok = ours == theirs
        same += ok
        print(
            f"{prompt.id} ({len(t_ids)} prompt tokens): "
            f"{'same' if ok else f'differs (first at token {first}, lengths {len(ours)}/{len(theirs)})'}"
        )
    print(f"{same}/{len(prompts)} identical ({'repacked' if repacked else 'plain'} weights)")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", nargs="?", default="mtbench", choices=("humaneval", "mtbench"))
    parser.add_argument("n", nargs="?", type=int, default=10)
    parser.add_argument("--plain-weights", action="store_true", help="both sides without repacked weights")
    args = parser.parse_args()
    sys.exit(main(args.dataset, args.n, not args.plain_weights))
