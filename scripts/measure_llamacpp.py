"""The runners side by side on this CPU: plain decoding speed of a model on llama.cpp (its GGUF as it is), on
transformers fp32 with PyTorch's default Linear and with oneDNN Linear layers; and each runner's step cost and verify
cost v(k), written as a profile that `usd project --profile` reads.

    PYTHONPATH=. python scripts/measure_llamacpp.py --json docs/bench/cpu-runners.json \\
        qwen2.5-coder-1.5b-instruct smollm2-135m-instruct

Same process, interleaved repetitions, medians. A step is one forward of one new token at a ~300-token context;
v(k) is a forward of k+1 new tokens with logits for each, in single steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from usd.catalog import load_catalog
from usd.loading import load_model
from usd.runners import runner_for
from usd.runners.transformers import cpu_kernels

FUNC = 'def add_{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
PROMPT = "".join(FUNC.format(i=i) for i in range(14))
STEPS, REPS, KS = 16, 5, range(1, 9)


def decode_rate(model, ids) -> float:
    """Greedy tokens per second of plain decoding after the prompt (prefill not counted)."""
    ctx = runner_for(model).new_context(ids[:-1])
    ctx.forward(keep=1)
    ctx.ids.append(ids[-1])
    t0 = time.perf_counter()
    for _ in range(STEPS):
        ctx.ids.append(int(ctx.forward(keep=1)[-1].argmax()))
    return STEPS / (time.perf_counter() - t0)


def forward_times(model, ids) -> dict:
    """Median seconds of a forward of 1 new token (step_s) and of k+1 new tokens (verify_s[k])."""
    ctx = runner_for(model).new_context(ids)
    ctx.forward(keep=1)
    n = len(ctx.ids)
    times: dict[int, list[float]] = {k: [] for k in [0, *KS]}
    for _ in range(REPS):
        for k in times:
            ctx.ids.extend(ids[10 : 11 + k])
            t0 = time.perf_counter()
            ctx.forward(keep=k + 1)
            times[k].append(time.perf_counter() - t0)
            ctx.truncate(n)
    return {"step_s": statistics.median(times[0]), "verify_s": {str(k): statistics.median(times[k]) for k in KS}}


RUNNERS = ("gguf", "fp32", "fp32-onednn")


def runners(entry, which=RUNNERS):
    """(label, model, switch) for each way this CPU can run the model (of those in `which`); switch() puts it in that
    state."""
    out, tokenizer = [], None
    if "gguf" in which:
        g = load_model(entry, device="cpu", precision="gguf", log=lambda m: None)
        out.append(("gguf", g.model, lambda: None))
        tokenizer = g.tokenizer
    if {"fp32", "fp32-onednn"} & set(which):
        f = load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
        if "fp32" in which:
            out.append(("fp32", f.model, lambda: cpu_kernels.use_default(f.model)))
        if "fp32-onednn" in which:
            out.append(("fp32-onednn", f.model, lambda: cpu_kernels.use_onednn(f.model)))
        tokenizer = f.tokenizer
    return out, tokenizer


def short(name: str) -> str:
    return name.removesuffix("-instruct")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--json", metavar="OUT", help="write a usd project profile")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the decode-rate measurement")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="which of them, comma-separated")
    parser.add_argument("--update", action="store_true", help="keep the other entries of an existing --json profile")
    args = parser.parse_args()
    which = args.runners.split(",")
    catalog = load_catalog()
    profile: dict = {
        "device": f"cpu ({torch.get_num_threads()} threads), {platform.processor() or platform.machine()}",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "context": None,
        "models": {},
    }
    for name in args.models:
        ways, tok = runners(catalog.get(name), which)
        ids = tok.encode(PROMPT)
        profile["context"] = len(ids)
        rates: dict[str, list[float]] = {label: [] for label, _, _ in ways}
        for _ in range(args.rounds):  # interleaved
            for label, model, switch in ways:
                switch()
                rates[label].append(decode_rate(model, ids))
        print(f"{name}: {len(ids)}-token prompt, plain decoding tok/s (median of {args.rounds}):")
        for label, model, switch in ways:
            switch()
            costs = forward_times(model, ids)
            profile["models"][f"{short(name)}@{label}"] = {"precision": label, **costs}
            v = ", ".join(f"{k}: {s / costs['step_s']:.2f}" for k, s in costs["verify_s"].items())
            rate = statistics.median(rates[label])
            print(f"  {label:12s} {rate:6.1f} tok/s, step {costs['step_s'] * 1e3:.1f} ms, v(k) {v}")
        del ways
    if args.json:
        if args.update and Path(args.json).exists():
            old = json.loads(Path(args.json).read_text(encoding="utf-8"))
            profile["models"] = {**old.get("models", {}), **profile["models"]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=1)
        print(f"profile: {args.json}")


if __name__ == "__main__":
    from usd.hugepages import restart_with_huge_pages

    restart_with_huge_pages()  # the weights in huge pages, as in `usd` and the app
    main()
