"""`usd project`: the speedup a pair should reach on profiled hardware, by the theory of DESIGN.md section 2:

    S(k) = tau(alpha, k) / (k c + v(k)),   tau = (1 - alpha^(k+1)) / (1 - alpha),
    c = drafter step / target step,        v(k) = verify forward of k + 1 tokens / target step.

c and v come from a profile that scripts/gpu_profile.py measured (random weights from the real configs, so no
download); alpha is given, or read from a `usd bench --json` result (it depends on the pair and the prompts, not on
the hardware, so a CPU benchmark's alpha carries over to a GPU). The n-gram lookup (`ngram`) runs no model, so its
c is 0: its round costs its verify alone, and it needs no drafter in the profile.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..algorithms import DRAFTING, LOOKING_UP
from ..theory import expected_speedup, tau

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
"""The profiles that ship with the package (usd/profiles)."""
FIXED = tuple(a.value for a in (*DRAFTING, *LOOKING_UP))
"""The algorithms that draft the same way every round, so that one alpha describes them (standard, tli, slem, ngram)."""
FREE = tuple(a.value for a in LOOKING_UP)
"""The algorithms whose draft runs no model: c = 0."""


def load_profiles(path: str | None = None) -> list[tuple[str, dict]]:
    files = [Path(path)] if path else sorted(PROFILES.glob("*.json"))
    out = []
    for f in files:
        try:
            out.append((f.name, json.loads(f.read_text())))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read profile {f}: {e}") from None
    return out


def _find(models: dict, spec: str) -> dict | None:
    if spec in models:
        return models[spec]
    matches = [k for k in models if k.partition("@")[0] == spec]
    if len(matches) > 1:
        raise ValueError(
            f"{spec!r} was profiled at several precisions or steps ({', '.join(matches)}); name one as it is keyed"
        )
    return models[matches[0]] if matches else None


def costs(profile: dict, target: str, drafter: str | None) -> tuple[float | None, dict[int, float]]:
    """(c, {k: v(k)}) for a target and a drafter of the profile (NAME or NAME@PRECISION); c is None without a
    drafter (what the lookup needs is the target's verify alone)."""
    t = _find(profile["models"], target)
    d = _find(profile["models"], drafter) if drafter else None
    if t is None or (drafter and d is None):
        missing = [name for name, m in ((target, t), (drafter, d)) if name and m is None]
        raise ValueError(f"{', '.join(missing)} not in the profile ({', '.join(profile['models'])})")
    step = t["step_s"]
    c = d["step_s"] / step if d is not None else None
    return c, {int(k): s / step for k, s in t["verify_s"].items()}


def project(alpha: float, c: float, v: dict[int, float] | float, k_max: int = 8) -> list[dict]:
    """Expected tau and speedup for k = 1..k_max; v is per k (a profile) or one number (the same for every k)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be between 0 and 1, got {alpha}")
    rows = []
    for k in range(1, k_max + 1):
        vk = v if isinstance(v, (int, float)) else v.get(k)
        if vk is None:
            break
        rows.append(
            {
                "k": k,
                "tau": tau(alpha, k),
                "c": c,
                "v": vk,
                "speedup": expected_speedup(alpha, k, c, vk),
            }
        )
    return rows


def alphas_from_bench(result: dict) -> dict[str, float]:
    """Measured acceptance per algorithm (standard, tli, slem, ngram) of a `usd bench --json` result (mean over its
    k)."""
    summaries = [p["summary"] for p in result["pairs"]] if "pairs" in result else [result["summary"]]
    by: dict[str, list[float]] = {}
    for summary in summaries:
        for row in summary:
            # auto mixes plain steps and algorithms round by round: its alpha describes no single algorithm
            if row["algorithm"] in FIXED and row.get("acceptance_rate"):
                by.setdefault(row["algorithm"], []).append(row["acceptance_rate"])
    if not by:
        raise ValueError("the bench result has no drafting algorithm with an acceptance rate")
    return {a: sum(xs) / len(xs) for a, xs in by.items()}


def add_arguments(p) -> None:
    p.add_argument("--target-config", metavar="NAME[@PREC]", help="target as named in the profile")
    p.add_argument("--drafter-config", metavar="NAME[@PREC]", help="drafter as named in the profile")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--alpha", type=float, help="acceptance rate to project with")
    p.add_argument(
        "--ngram",
        action="store_true",
        help="project the n-gram lookup at --alpha: c = 0 (no model), so no --drafter-config is needed",
    )
    src.add_argument("--from-bench", metavar="JSON", help="take alpha per algorithm from a `usd bench --json` file")
    p.add_argument("--profile", help="a profile from scripts/gpu_profile.py (default: those in usd/profiles)")
    p.add_argument("--c", type=float, help="instead of a profile: drafter step / target step (what-if)")
    p.add_argument("--v", type=float, help="instead of a profile: verify forward / target step, every k (what-if)")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print JSON")


def _from_profiles(args):
    profiles = load_profiles(args.profile)
    if not profiles:
        raise ValueError("no profile: run scripts/gpu_profile.py on the hardware to project to and pass --profile")
    errors = []
    for name, profile in profiles:
        try:
            return (name, profile, *costs(profile, args.target_config, args.drafter_config))
        except ValueError as e:
            errors.append(f"{name}: {e}")
    raise ValueError("no profile has both models. " + "; ".join(errors))


def run_cli(args) -> int:
    if args.from_bench:
        try:
            alphas = alphas_from_bench(json.loads(Path(args.from_bench).read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read alpha from {args.from_bench}: {e}") from None
    else:
        alphas = {FREE[0] if args.ngram else "given": args.alpha}
    only_free = all(a in FREE for a in alphas)
    if (args.c is None) != (args.v is None) and not (only_free and args.v is not None):
        raise ValueError("--c and --v go together (a what-if without a profile)")
    if args.v is not None:
        name, profile, c, v = "what-if (--c, --v)", {"device": "given c and v"}, args.c, args.v
    else:
        if not (args.target_config and (args.drafter_config or only_free)):
            raise ValueError("name the models with --target-config and --drafter-config (or give --c and --v)")
        name, profile, c, v = _from_profiles(args)
    c_of = {a: 0.0 if a in FREE or c is None else c for a in alphas}  # (c is None only where every alpha is free)
    out = {
        "profile": name,
        "device": profile.get("device"),
        "target": args.target_config,
        "drafter": args.drafter_config,
        "c": c,
        "projections": {a: project(alpha, c_of[a], v, args.k_max) for a, alpha in alphas.items()},
        "alpha": alphas,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{args.target_config or 'target'} + {args.drafter_config or 'drafter'} on {out['device']} ({name}): "
        + (f"c = {c:.3f}" if c is not None else "no drafter model")
    )
    for a, rows in out["projections"].items():
        best = max(rows, key=lambda r: r["speedup"])
        free = " (a lookup: c = 0)" if a in FREE else ""
        print(f"\n{a}{free}: alpha = {alphas[a]:.2f}; best k = {best['k']}, expected speedup {best['speedup']:.2f}x")
        print("| k | tau | v | expected speedup |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['k']} | {r['tau']:.2f} | {r['v']:.2f} | {r['speedup']:.2f}x |")
    return 0
