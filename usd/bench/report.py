"""A benchmark result for people: its rows' labels, the Markdown table `usd bench` prints, and where each pair's
figure goes. Shared by the run (usd.bench.run) and the figures (usd.bench.plots), which import nothing of each
other."""

from __future__ import annotations

REFERENCES = ("hf", "llamacpp")
"""Generations that are not ours, which only the benchmark runs: `hf`, transformers' own assisted generation, and
`llamacpp`, llama-cpp-python's own generate on the target's GGUF (what a CPU user would otherwise run). They run once
per prompt at their own draft length, and have no rounds or acceptance."""


def label(algorithm: str, k) -> str:
    return algorithm if k in (0, None) else f"{algorithm} k={k}"


def _fmt(x, spec=".2f"):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def _speedup(x) -> str:
    return _fmt(x) + ("x" if x else "")


def _identity(row: dict) -> str:
    rate = row.get("identical_rate")
    return "-" if rate is None else ("yes" if rate == 1 else f"NO: {rate:.0%}")


def _by_source(alphas: dict | None) -> str:
    return " · ".join(f"{source} {alpha:.2f}" for source, alpha in alphas.items()) if alphas else "-"


def table(summary: list[dict], dtype: str | None = None) -> str:
    """The summary as a Markdown table; `dtype`, the precision the target ran in, heads the identity column. The
    llama.cpp column appears when the run has that reference."""
    vs_llama = any(r.get("speedup_vs_llamacpp") for r in summary)
    head = [
        "algorithm",
        "wall s",
        "tok/s",
        "vs none",
        "vs hf",
        *(["vs llama.cpp"] if vs_llama else []),
        "alpha",
        "alpha by source",
        "tau",
        "mean k",
        "c",
        "v",
        "overhead",
        "predicted",
        f"identical ({dtype})" if dtype else "identical",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary:
        cells = [
            label(r["algorithm"], r["k"]),
            _fmt(r["wall_s"], ".1f"),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup_vs_none"]) + ("x" if r["speedup_vs_none"] else ""),
            _fmt(r["speedup_vs_hf"]) + ("x" if r["speedup_vs_hf"] else ""),
            *([_speedup(r.get("speedup_vs_llamacpp"))] if vs_llama else []),
            _fmt(r["acceptance_rate"]),
            _by_source(r.get("alpha_by_source")),
            _fmt(r["tokens_per_round"]),
            _fmt(r["mean_k"], ".1f"),
            _fmt(r["c"]),
            _fmt(r["v"]),
            _fmt(r["overhead_share"] * 100 if r["overhead_share"] is not None else None, ".1f")
            + ("%" if r["overhead_share"] is not None else ""),
            _speedup(r.get("predicted_speedup")),
            _identity(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pair_plot_path(path: str, result: dict) -> str:
    """Where one pair's figure goes when a run holds several pairs: OUT-TARGET+DRAFTER.png."""
    tag = f"{result['machine']['target']}+{result['machine']['drafter']}"
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{tag}.{ext}" if dot else f"{path}-{tag}"
