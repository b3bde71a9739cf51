"""Our plain greedy decoding on the llama.cpp runner against llama-cpp-python's own generate of the same GGUF, both
with one kernel for every batch (flash attention, f16 K and bf16 V cache, plain weights, the tiled matmul off in this
process), so that their batching does not matter: the tokens must be the same. This checks the runner's loop, cache
and rollback against llama.cpp's own. With the kernels each uses by default (`usd bench --algorithms ...,llamacpp`)
they may differ at near-ties: llama.cpp reads a prompt's last token in the prompt's batch, our runner on the row
kernels (usd/llamacpp.py).

    PYTHONPATH=. python scripts/check_llamacpp_reference.py [humaneval|mtbench] [N]
"""

from __future__ import annotations

import os
import sys

import llama_cpp
import llama_cpp.llama_cpp as low_level

import usd
from usd import decoder, llamacpp
from usd.bench.run import _ids, forget_caches
from usd.datasets import load_prompts
from usd.sampling import SamplingParams

MAX_NEW = 64


def reference_with_our_kernels(model: llamacpp.LlamaCppModel) -> llama_cpp.Llama:
    os.environ["GGML_CPU_TILED_MM"] = "0"  # read once, at llama.cpp's first matmul: set before any
    default_params = low_level.llama_model_default_params

    def without_repacking():
        params = default_params()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_repacking  # Llama() has no argument for it
    try:
        return llama_cpp.Llama(
            model_path=str(model.path),
            n_ctx=model.n_ctx,
            n_threads=model.n_threads,
            flash_attn=True,
            type_k=llamacpp.GGML_TYPE_F16,
            type_v=llamacpp.GGML_TYPE_BF16,
            verbose=False,
        )
    finally:
        low_level.llama_model_default_params = default_params


def main(dataset: str, n: int) -> int:
    pair = usd.load_pair(precision="gguf", log=lambda m: None)
    loaded = pair.target
    pair.target = llamacpp.LlamaCppModel(
        loaded.path, n_ctx=loaded.n_ctx, name=loaded.name_or_path, repacked_weights=False
    )
    pair.target.generation_config = loaded.generation_config
    llm = reference_with_our_kernels(pair.target)
    eos = pair.eos_ids()
    same = 0
    prompts = load_prompts(dataset, n)
    for prompt in prompts:
        t_ids, d_ids = _ids(pair, prompt)
        forget_caches(pair)
        *_, done = decoder.stream(pair, t_ids, d_ids, algorithm="none", params=SamplingParams(), max_new_tokens=MAX_NEW)
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
            f"{prompt.id}: {'same' if ok else f'differs (first at token {first}, lengths {len(ours)}/{len(theirs)})'}"
        )
    print(f"{same}/{len(prompts)} identical")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mtbench", int(sys.argv[2]) if len(sys.argv) > 2 else 10))
