"""`usd bench --plot`: the benchmark's figures as one PNG (matplotlib, no display needed).

Panels: speedup over plain decoding per algorithm; with `--draft-tokens sweep`, acceptance rate and tau against the
draft length; and the measured speedup beside the theoretical S(k) = tau(alpha, k) / (k c + v) for the measured alpha,
c and v, which shows how much of the gap to theory the loop itself leaves.
"""

from __future__ import annotations

from ..algorithms import PLAIN, Algorithm
from ..theory import expected_speedup
from .report import REFERENCES, label, pair_plot_path

DRAFTING = tuple(a.value for a in Algorithm if not a.plain)


def _k(row: dict) -> float:
    """Where a row sits on the draft-length axis: its fixed k, or the mean k it used when k adapted."""
    return row["k"] if isinstance(row["k"], int) else row["mean_k"]


def theory_points(rows: list[dict], ks=range(1, 9)) -> list[tuple[int, float]]:
    """S(k) for an algorithm's rows: alpha and c averaged over its rows, v per k where measured at that k (it grows
    with k on a CPU), else the mean v."""
    rows = [r for r in rows if r["acceptance_rate"] is not None]
    cs = [r["c"] for r in rows if r["c"] is not None]
    v_all = [r["v"] for r in rows if r["v"] is not None]
    if not rows or not cs or not v_all:
        return []
    alpha = sum(r["acceptance_rate"] for r in rows) / len(rows)
    c = sum(cs) / len(cs)
    v_at = {r["k"]: r["v"] for r in rows if r["v"] is not None and isinstance(r["k"], int)}
    v_mean = sum(v_all) / len(v_all)
    return [(k, expected_speedup(alpha, k, c, v_at.get(k, v_mean))) for k in ks]


def plot(result: dict, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    drafting = [r for r in summary if r["algorithm"] in DRAFTING]
    swept = len({r["k"] for r in drafting}) > 1
    panels = 3 if swept else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 4.2))

    ax = axes[0]
    rows = [r for r in summary if r["speedup_vs_none"] is not None]
    ax.bar(
        [label(r["algorithm"], r["k"]) for r in rows],
        [r["speedup_vs_none"] for r in rows],
        color=["#94a3b8" if r["algorithm"] in (PLAIN, *REFERENCES) else "#16a34a" for r in rows],
    )
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("speedup over plain decoding (wall time)")
    ax.set_title("speedup per algorithm")
    ax.tick_params(axis="x", rotation=60, labelsize=7 if len(rows) > 8 else 9)

    by_algorithm: dict[str, list[dict]] = {}
    for r in drafting:
        if r["mean_k"]:  # an algorithm that never drafted (auto settled on plain decoding) has nothing to plot
            by_algorithm.setdefault(r["algorithm"], []).append(r)
    if swept:
        ax = axes[1]
        for a, rs in by_algorithm.items():
            rs = sorted(rs, key=_k)
            ks = [_k(r) for r in rs]
            ax.plot(ks, [r["acceptance_rate"] for r in rs], marker="o", label=f"{a} alpha")
            ax.plot(ks, [r["tokens_per_round"] for r in rs], marker="s", ls="--", label=f"{a} tau")
        ax.set_xlabel("draft length k")
        ax.set_title("acceptance rate alpha and tokens per forward tau")
        ax.legend(fontsize=8)

    ax = axes[-1]
    # auto mixes plain steps and algorithms round by round: no single alpha, c and v describe it, so no curve
    fixed = {a: rs for a, rs in by_algorithm.items() if a != Algorithm.AUTO}
    for i, (a, rs) in enumerate(fixed.items()):
        colour = f"C{i}"
        curve = theory_points(rs)
        if curve:
            ax.plot(*zip(*curve, strict=True), color=colour, label=f"{a} theory S(k)")
        measured = [(_k(r), r["speedup_vs_none"]) for r in rs if r["speedup_vs_none"] is not None]
        if measured:
            ax.scatter(*zip(*measured, strict=True), color=colour, marker="x", s=60, label=f"{a} measured")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("measured vs theory (measured alpha, c, v)")
    if fixed:
        ax.legend(fontsize=8)

    m = result.get("machine", {})
    fig.suptitle(
        title
        or f"{m.get('target', '?')} + {m.get('drafter', '?')} on {m.get('cuda') or m.get('processor')}"
        f" ({result.get('settings', {}).get('dataset', '')})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python -m usd.bench.plots BENCH.json OUT.png`: draw a saved `usd bench --json` result again."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m usd.bench.plots BENCH.json OUT.png", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        result = json.load(f)
    results = result.get("pairs", [result])
    for r in results:
        plot(r, args[1] if len(results) == 1 else pair_plot_path(args[1], r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
