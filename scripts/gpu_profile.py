"""Measure c and v on this machine with random-weight models built from real configs, and print a profile for
`usd project`. No download: weight values do not change how long a forward takes.

    python scripts/gpu_profile.py --model llama-3.1-8b@nf4 --model llama-3.1-8b@bf16 --model smollm2-135m@bf16 \\
        --out usd/profiles/h200.json

NAME is a config in scripts/configs/ (or a path to a config.json); PRECISION one of nf4, int8 (bitsandbytes, CUDA only),
bf16, fp16, fp32. Each model is timed the way the decode loop uses it (usd.runners.transformers.Context): after a prompt
of --context tokens, a single-token step and a verify forward of k + 1 tokens for k = 1..--k-max, each the median of
--reps runs, with the cache cropped back after each. `--steps dynamic,static,compiled` times each model on each kind of
decoding step a GPU may choose at load (usd/runners/transformers/static_cache.py); kinds other than transformers' own
cache are keyed NAME@PRECISION#KIND. `--tiny` shrinks every config to two small layers: the CPU smoke test that keeps
this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from usd.loading import bnb_config, torch_dtype  # noqa: E402
from usd.runners.transformers import Context, TransformersRunner  # noqa: E402
from usd.runners.transformers.static_cache import KINDS  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def config_for(name: str, tiny: bool):
    from transformers import AutoConfig

    path = Path(name) if name.endswith(".json") else CONFIGS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise SystemExit(f"no config {path}; known: {known}, or a path to a config.json")
    cfg = AutoConfig.from_pretrained(path)
    if tiny:
        for key, value in TINY.items():
            setattr(cfg, key, value)
    return cfg


def build(cfg, precision: str, device: str):
    """A random-weight model at `precision` on `device`. Quantized ones go through a saved copy, so bitsandbytes
    quantizes them exactly as it does a real checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    quant = bnb_config(precision)
    if quant is None:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype(precision))
        return model.eval()
    if device != "cuda":
        raise SystemExit(f"{precision} needs bitsandbytes on CUDA; use bf16/fp16/fp32 on {device}")
    with tempfile.TemporaryDirectory() as tmp:
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp)
        torch.cuda.empty_cache()
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.bfloat16, quantization_config=quant, device_map="cuda"
        )
    return model.eval()


def timed(ctx: Context, n: int, reps: int) -> float:
    """Median seconds of feeding n new tokens (logits kept for all n, as a verify does), cropped back each time."""
    base = len(ctx.ids)
    vocab = ctx.model.config.vocab_size
    times = []
    for _ in range(reps):
        ctx.ids += torch.randint(vocab, (n,)).tolist()
        t0 = time.perf_counter()
        ctx.forward(keep=n)
        times.append(time.perf_counter() - t0)
        ctx.truncate(base)
    return statistics.median(times)


def profile_model(spec: str, device: str, context: int, k_max: int, reps: int, tiny: bool, steps: list[str]) -> dict:
    """{step kind: timings} for one model, built once and timed on each kind of decoding step in turn."""
    name, _, precision = spec.partition("@")
    precision = precision or ("bf16" if device == "cuda" else "fp32")
    cfg = config_for(name, tiny)
    model = build(cfg, precision, device)
    params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(cfg.vocab_size, (context,)).tolist()  # the same context for every kind
    out = {}
    for step in steps:
        # which decoding steps (usd/runners/transformers/static_cache.py): transformers' cache, static, compiled
        ctx = TransformersRunner(model, step).new_context(prompt)
        ctx.forward(keep=1)  # prefill
        timed(ctx, 1, 3)  # warm-up: kernels, allocator, a compile
        out[step] = {
            "precision": precision,
            "step": step,
            "params": params,
            "step_s": timed(ctx, 1, reps),
            "verify_s": {str(k): timed(ctx, k + 1, reps) for k in range(1, k_max + 1)},
        }
        del ctx
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME@PRECISION")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before timing (default 512)")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--steps", default="dynamic", help=f"comma-separated decoding steps to time each model with: {', '.join(KINDS)}"
    )
    p.add_argument("--tiny", action="store_true", help="two small layers per model: a CPU smoke test")
    p.add_argument("--out", help="also write the profile here")
    args = p.parse_args(argv)

    import transformers

    profile = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "context": args.context,
        "tiny": args.tiny,
        "models": {},
    }
    for spec in args.model:
        name = spec.partition("@")[0]
        key = Path(name).stem if name.endswith(".json") else name
        per_step = profile_model(
            spec, args.device, args.context, args.k_max, args.reps, args.tiny, args.steps.split(",")
        )
        for step, entry in per_step.items():
            suffix = "" if step == "dynamic" else f"#{step}"  # transformers' cache keeps the key `usd project` reads
            profile["models"][f"{key}@{entry['precision']}{suffix}"] = entry
            print(
                f"{spec} ({step}): step {entry['step_s'] * 1e3:.2f} ms, "
                f"verify k=4 {entry['verify_s'].get('4', 0) * 1e3:.2f} ms",
                file=sys.stderr,
            )
    text = json.dumps(profile, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
