#!/usr/bin/env bash
# The GPU checks, as one run on a lent GPU machine (the `device` tool), which reaches no package registry and whose
# image has its own torch and an older transformers, and no bitsandbytes or pydantic:
#
#   bash scripts/gpu_checks.sh prepare     # here: the wheels the machine lacks, into .gpu-wheels/ (git-ignored)
#   run(command="bash scripts/gpu_checks.sh run", carry=[".gpu-wheels"], timeout_s=540)   # there
#
# `run` writes under $OUT: check.jsonl (scripts/gpu_check_quantized.py: NF4, int8 and bf16 loads, the decoding steps
# each load chose and a speculative-against-plain check) and one profile per model (scripts/gpu_profile.py: c and
# v(k) on each kind of decoding step, usd/static_cache.py). Each part has its own time limit, so a slow one still
# leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    py=.venv/bin/python
    version=$($py -c "import transformers; print(transformers.__version__)")
    mkdir -p .gpu-wheels
    grep -qxF "/.gpu-wheels/" .git/info/exclude 2>/dev/null || echo "/.gpu-wheels/" >>.git/info/exclude
    # the machine's python3 is 3.12 on x86-64; bitsandbytes' CUDA wheels are tagged manylinux_2_24
    where=(--only-binary=:all: --python-version 3.12 -d .gpu-wheels --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    # transformers' own dependencies are in the image (huggingface_hub, tokenizers, safetensors); pydantic's are not
    $py -m pip download --no-deps "${where[@]}" "transformers==$version" bitsandbytes || exit 1
    $py -m pip download "${where[@]}" pydantic platformdirs || exit 1
    du -sh .gpu-wheels
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    site=/tmp/usd-gpu-site
    python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 USD_CHAT_CACHE=/tmp/usd-gpu-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
    timeout 150 python3 scripts/gpu_check_quantized.py >"$out/check.jsonl" 2>"$out/check.err"
    echo "gpu_check_quantized: rc=$?"
    cat "$out/check.jsonl"
    for model in smollm2-135m@bf16 qwen2.5-coder-1.5b@bf16 qwen2.5-coder-1.5b@nf4; do
        timeout 110 python3 scripts/gpu_profile.py --model "$model" --steps dynamic,static,compiled --reps 10 \
            --out "$out/profile-${model/@/-}.json" 2>>"$out/profile.err" >/dev/null
        echo "gpu_profile $model: rc=$?"
    done
    tail -20 "$out/profile.err"
    ;;
*)
    echo "usage: bash scripts/gpu_checks.sh prepare|run" >&2
    exit 2
    ;;
esac
