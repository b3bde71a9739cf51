"""The `usd` command line: pull, models, overlap (generate and bench come with the engine)."""

from __future__ import annotations

import argparse
import json
import sys

from .catalog import CatalogError, load_catalog
from .loading import LoadError, default_device, entry_for, plan_load
from .store import StoreError, local_path, pull


def _catalog(args):
    return load_catalog(user_path=getattr(args, "catalog", None))


def cmd_pull(args) -> int:
    catalog = _catalog(args)
    names = catalog.names() if args.all else args.names
    if not names:
        raise SystemExit("usd pull: name at least one model, or --all (`usd models` lists them)")
    failed = 0
    for name in names:
        entry = entry_for(name, catalog)
        try:
            path = pull(entry, verify=args.verify, log=lambda m: print(m, file=sys.stderr))
        except StoreError as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: ready at {path}")
    return 1 if failed else 0


def cmd_models(args) -> int:
    catalog = _catalog(args)
    device = default_device()
    rows = []
    for m in catalog.models:
        path = local_path(m)
        plan = plan_load(m, device)
        rows.append({
            "name": m.name, "family": m.family, "roles": m.roles, "source": m.source.kind,
            "params_b": m.params_b, "context_length": m.context_length, "license": m.license,
            "chat_template": m.chat_template, "trust_remote_code": m.trust_remote_code,
            "precision": plan.precision, "device": device, "estimate_gib": round(plan.estimate_bytes / 2**30, 2),
            "ready": path is not None, "path": str(path) if path else None,
            "default": m.name in (catalog.default.target, catalog.default.drafter),
        })  # fmt: skip
    if args.json:
        json.dump({"models": rows, "default": catalog.default.model_dump(),
                   "pairs": [p.model_dump() for p in catalog.pairs]}, sys.stdout, indent=1)  # fmt: skip
        print()
        return 0
    print(f"{'name':32} {'family':10} {'roles':15} {'source':6} {'params':>7} {'precision':9} {'~GiB':>6}  ready")
    for r in rows:
        params = f"{r['params_b']:.2f}B" if r["params_b"] else "?"
        star = " (default)" if r["default"] else ""
        print(f"{r['name']:32} {r['family']:10} {'/'.join(r['roles']):15} {r['source']:6} {params:>7} "
              f"{r['precision']:9} {r['estimate_gib']:6.2f}  {'yes' if r['ready'] else 'no'}{star}")  # fmt: skip
    print(f"\nprecision and memory are for this machine's device ({device}). Suggested pairs:")
    for p in catalog.pairs:
        print(f"  {p.target} + {p.drafter}: {p.why}")
    return 0


def cmd_overlap(args) -> int:
    from .loading import load_tokenizer
    from .vocab import overlap_report

    catalog = _catalog(args)
    sides = []
    for name in (args.target, args.drafter):
        entry = entry_for(name, catalog)
        path = pull(entry, log=lambda m: print(m, file=sys.stderr))
        tokenizer = load_tokenizer(entry, path)
        sides.append((tokenizer, _config_vocab(path)))
    report = overlap_report(sides[0][0], sides[1][0], sides[0][1], sides[1][1])
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"target  {args.target}: {report['target_vocab']:,} tokens ({report['target_tokenizer']})")
    print(f"drafter {args.drafter}: {report['drafter_vocab']:,} tokens ({report['drafter_tokenizer']})")
    print(f"shared (as raw bytes): {report['shared']:,}  = {report['shared_pct_target']:.1f}% of the target's, "
          f"{report['shared_pct_drafter']:.1f}% of the drafter's vocabulary")  # fmt: skip
    print(f"shared without byte normalisation (identical spellings): {report['shared_without_normalisation']:,}")
    return 0


def _config_vocab(path) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="usd", description="Universal speculative decoding: lossless, any pair.")
    parser.add_argument("--catalog", metavar="FILE", help="a file of your own model entries, merged over models.yaml "
                        "(default: $USD_CHAT_MODELS)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch, verify and convert models (idempotent)")
    p.add_argument("names", nargs="*", metavar="NAME", help="catalog names, local paths or hub ids")
    p.add_argument("--all", action="store_true", help="every catalog model")
    p.add_argument("--verify", action="store_true", help="re-hash every cached file, not only changed ones")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list the catalog and what is ready locally")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("overlap", help="how much of two vocabularies is shared, compared as raw bytes")
    p.add_argument("target")
    p.add_argument("drafter")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_overlap)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CatalogError, StoreError, LoadError) as e:
        print(f"usd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
