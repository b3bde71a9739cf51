"""Plain decoding speed on the llama.cpp runner against transformers fp32, and the llama runner's verify cost v(k).

    PYTHONPATH=. python scripts/measure_llamacpp.py qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

Same process, interleaved repetitions, medians. A step is one forward of one new token at a ~300-token context;
v(k) is a forward of k+1 new tokens with logits for each, in single steps.
"""

from __future__ import annotations

import statistics
import sys
import time

from usd.catalog import load_catalog
from usd.loading import load_model
from usd.pair import open_context

FUNC = 'def add_{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
PROMPT = "".join(FUNC.format(i=i) for i in range(14))
STEPS, REPS = 16, 5


def decode_rate(model, ids) -> float:
    """Greedy tokens per second of plain decoding after the prompt (prefill not counted)."""
    ctx = open_context(model, ids[:-1])
    ctx.forward(keep=1)
    ctx.ids.append(ids[-1])
    t0 = time.perf_counter()
    for _ in range(STEPS):
        ctx.ids.append(int(ctx.forward(keep=1)[-1].argmax()))
    return STEPS / (time.perf_counter() - t0)


def verify_costs(model, ids, ks=range(1, 9)) -> dict[int, float]:
    ctx = open_context(model, ids)
    ctx.forward(keep=1)
    n = len(ctx.ids)
    times: dict[int, list[float]] = {k: [] for k in [0, *ks]}
    for _ in range(REPS):
        for k in times:
            ctx.ids.extend(ids[10 : 11 + k])  # k+1 new tokens
            t0 = time.perf_counter()
            ctx.forward(keep=k + 1)
            times[k].append(time.perf_counter() - t0)
            ctx.truncate(n)
    step = statistics.median(times[0])
    return {"step_ms": step * 1e3, **{k: statistics.median(times[k]) / step for k in ks}}


def main(names: list[str]) -> None:
    catalog = load_catalog()
    for name in names:
        entry = catalog.get(name)
        g = load_model(entry, device="cpu", precision="gguf", log=lambda m: None)
        f = load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
        ids = g.tokenizer.encode(PROMPT)
        rates = {"gguf": [], "fp32": []}
        for _ in range(3):  # interleaved
            rates["gguf"].append(decode_rate(g.model, ids))
            rates["fp32"].append(decode_rate(f.model, ids))
        print(
            f"{name}: {len(ids)}-token prompt, plain decoding tok/s (median of 3): llama.cpp "
            f"{statistics.median(rates['gguf']):.1f}, transformers fp32 {statistics.median(rates['fp32']):.1f}"
        )
        v = verify_costs(g.model, ids)
        print(f"  llama.cpp step {v.pop('step_ms'):.1f} ms; v(k) = " + ", ".join(f"{k}: {x:.2f}" for k, x in v.items()))
        del f


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen2.5-coder-0.5b-instruct"])
