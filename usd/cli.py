"""The `usd` command line: pull, models, overlap, generate, bench, suggest, project, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import chat
from .algorithms import Algorithm
from .catalog import CatalogError, add_pair_arguments, drafter_arg, load_catalog
from .loading import LoadError, check_local_dir, default_device, entry_for, needs_conversion, plan_load
from .settings import (
    ALGORITHMS,
    DEFAULT_MAX_NEW_TOKENS,
    DRAFT_TOKENS_MAX,
    PRECISIONS,
    TEMPERATURE_MAX,
    GenerationSettings,
)
from .store import StoreError, forms_on_disk, local_path, pull


def _catalog(args):
    return load_catalog(user_path=getattr(args, "catalog", None))


def cmd_pull(args) -> int:
    catalog = _catalog(args)
    names = catalog.names() if args.all else args.names
    if not names:
        raise SystemExit("usd pull: name at least one model, or --all (`usd models` lists them)")
    failed = 0
    device = default_device()
    for name in names:
        entry = entry_for(name, catalog)
        try:
            # what this machine's runner for it reads: a GGUF model on llama.cpp needs no float32 copy
            converted = needs_conversion(entry, device, args.precision)
            path = pull(entry, verify=args.verify, log=lambda m: print(m, file=sys.stderr), converted=converted)
        except (StoreError, LoadError) as e:
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
        rows.append(
            {
                "name": m.name,
                "family": m.family,
                "roles": m.roles,
                "source": m.source.kind,
                "params_b": m.params_b,
                "context_length": m.context_length,
                "license": m.license,
                "chat_template": m.chat_template,
                "trust_remote_code": m.trust_remote_code,
                "precision": plan.precision,
                "device": device,
                "estimate_gib": round(plan.estimate_bytes / 2**30, 2),
                "ready": path is not None,
                "on_disk": list(forms_on_disk(m)),
                "path": str(path) if path else None,
                "default": m.name in (catalog.default.target, catalog.default.drafter),
            }
        )
    if args.json:
        json.dump(
            {"models": rows, "default": catalog.default.model_dump(), "pairs": [p.model_dump() for p in catalog.pairs]},
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    print(
        f"{'name':32} {'family':10} {'roles':15} {'source':6} {'params':>7} {'precision':9} {'~GiB':>6}  "
        f"{'on disk':16} ready"
    )
    for r in rows:
        params = f"{r['params_b']:.2f}B" if r["params_b"] else "?"
        star = " (default)" if r["default"] else ""
        print(
            f"{r['name']:32} {r['family']:10} {'/'.join(r['roles']):15} {r['source']:6} {params:>7} "
            f"{r['precision']:9} {r['estimate_gib']:6.2f}  {'+'.join(r['on_disk']) or '-':16} "
            f"{'yes' if r['ready'] else 'no'}{star}"
        )
    print(
        f"\nprecision and memory are for this machine's device ({device}). On disk: gguf is the GGUF as it is "
        "(llama.cpp), safetensors what transformers loads (a GGUF's float32 conversion, made at its first "
        "transformers load). Suggested pairs:"
    )
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
    print(
        f"shared (as raw bytes): {report['shared']:,}  = {report['shared_pct_target']:.1f}% of the target's, "
        f"{report['shared_pct_drafter']:.1f}% of the drafter's vocabulary"
    )
    print(f"shared without byte normalisation (identical spellings): {report['shared_without_normalisation']:,}")
    print(
        f"alpha ceiling for tli: {report['alpha_ceiling_tli']:.0%} (the share of the target's tokens, on sample code "
        "and prose, that the shared vocabulary can spell; slem drafts free text and is not bound by it)"
    )
    return 0


_COLOURS = {
    "accepted": "\x1b[32m",
    "rejected": "\x1b[2;9;31m",
    "resampled": "\x1b[33m",
    "bonus": "\x1b[36m",
    "target": "",
}  # green, dim struck-through red, yellow, cyan, plain
_RESET = "\x1b[0m"


def _at_least_one(value: str) -> int:
    if not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def _read_text(path: str, what: str) -> str:
    """A file's text; a ValueError (exit 2, like every input error) that names the file and the problem."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"cannot read the {what} from {path}: {e.strerror or e}") from None


def _messages(path: str):
    text = _read_text(path, "messages")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}; "
            'it must hold a list like [{"role": "user", "content": "..."}]'
        ) from None


def _from_file(path: str, read, check):
    """read(path), then the API's own check of what was read; its complaint names the file."""
    value = read(path)
    try:
        return check(value)
    except chat.PromptError as e:
        raise chat.PromptError(f"{path}: {e}") from None


def _generation_input(args) -> dict:
    """The prompt or conversation, read and checked (as api.stream will check it) before any model loads."""
    if args.messages_file:
        return {"messages": _from_file(args.messages_file, _messages, chat.check_messages)}
    if args.prompt_file:
        prompt = _from_file(args.prompt_file, lambda p: _read_text(p, "prompt"), chat.check_prompt)
    else:
        prompt = chat.check_prompt(args.prompt)
    return {"messages": chat.user_turn(prompt)} if args.chat else {"prompt": prompt}


def _settings(args) -> GenerationSettings:
    """The options as typed, checked by the settings model the API takes: the app's ranges and messages."""
    settings = GenerationSettings(
        algorithm=args.algorithm,
        draft_tokens=args.draft_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    if args.samples:  # seeds S..S+N-1, S = 0 without --seed: the last one is checked now too, not after loading
        first = settings.seed or 0
        try:
            settings.replace(seed=first + args.samples - 1)
        except ValueError as e:
            raise ValueError(f"{e} (the last of {args.samples} samples' seeds from {first})") from None
        settings = settings.replace(seed=first)
    return settings


def _check_models(args, algorithm: Algorithm, catalog) -> None:
    """Fail before loading on what is known without the weights: a spec that names no model, a local directory
    that lacks files, and 'standard' on tokenizers that differ. The drafter loads second, so its mistakes would
    otherwise show only after the target's whole load."""
    specs = [args.target or catalog.default.target]
    if algorithm.uses_drafter:
        specs.append(args.drafter or catalog.default.drafter)
    entries = [entry_for(spec, catalog) for spec in specs]
    for entry in entries:
        check_local_dir(entry)
    if algorithm.spec.one_tokenizer:
        _check_same_tokenizers(entries, algorithm)


def _check_same_tokenizers(entries, algorithm: Algorithm) -> None:
    from .decoder import resolve_algorithm
    from .loading import load_tokenizer
    from .pair import Pair

    target, drafter = (load_tokenizer(e, pull(e, log=_log)) for e in entries)
    # the decoder's own check on the tokenizers alone; it only asks whether a drafter is there, so stand-ins do
    resolve_algorithm(Pair(object(), target, object(), drafter), algorithm)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _result(done) -> dict:
    return {"text": done.text, "target_token_ids": list(done.target_ids), "stats": done.stats.as_dict()}


def cmd_generate(args) -> int:
    from . import api, suggest
    from .events import Finished

    catalog = _catalog(args)
    # every check that needs no model runs first: loading takes seconds, minutes for big models
    inputs = _generation_input(args)
    settings = _settings(args)
    _check_models(args, settings.algorithm, catalog)
    pair = api.load_pair(
        args.target,
        drafter_arg(args.drafter) if settings.algorithm.uses_drafter else False,
        catalog=catalog,
        device=args.device,
        precision=args.precision,
        log=_log,
    )
    colour = sys.stdout.isatty() and not args.json
    results = []
    for i in range(args.samples or 1):
        sample = settings if settings.seed is None else settings.replace(seed=settings.seed + i)
        events = suggest.recording(pair, api.stream(pair, **inputs, settings=sample), greedy=sample.greedy)
        for event in events:
            if isinstance(event, Finished):
                results.append(_result(event))
            elif not args.json:
                for piece in event.pieces:
                    if colour:
                        sys.stdout.write(_COLOURS[piece.kind] + piece.text + _RESET)
                    elif piece.kind != "rejected":
                        sys.stdout.write(piece.text)
                sys.stdout.flush()
        if not args.json:
            st = results[-1]["stats"]
            print()
            print(
                f"[{st['algorithm']}: {st['tokens']} tokens in {st['wall_s']:.2f} s, {st['tokens_per_s']:.1f} "
                f"tokens/s, alpha {st['acceptance_rate']:.2f}, tau {st['tokens_per_round']:.2f}, "
                f"stopped: {st['stop_reason']}]",
                file=sys.stderr,
            )
    if args.json:
        out = {"samples": results} if args.samples else results[0]
        print(json.dumps(out, ensure_ascii=False))
    return 0


def cmd_bench(args) -> int:
    from .bench.run import run_cli

    return run_cli(args, _catalog(args))


def cmd_suggest(args) -> int:
    from .suggest import run_cli

    return run_cli(args, _catalog(args))


def cmd_project(args) -> int:
    from .bench.projection import run_cli

    return run_cli(args)


def cmd_serve(args) -> int:
    from .serve.main import run_cli

    return run_cli(args, _catalog(args))


def _config_vocab(path) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    # the settings stay text here: GenerationSettings reads and checks them, with the app's ranges and messages
    p.add_argument("--algorithm", metavar=f"{{{','.join(ALGORITHMS)}}}", help="default: auto (picks per round)")
    p.add_argument(
        "--draft-tokens",
        metavar="{K,auto}",
        help=f"draft length per round, 1-{DRAFT_TOKENS_MAX}, or auto to adapt it (default)",
    )
    p.add_argument("--temperature", help=f"0 = greedy (default), up to {TEMPERATURE_MAX:g}")
    p.add_argument("--top-p", help="above 0, at most 1 (default: 1, off)")
    p.add_argument("--top-k", help="0 = off (default)")
    p.add_argument("--seed", help="random seed for sampling (with --samples: the first of N)")
    p.add_argument("--max-new-tokens", help=f"default: {DEFAULT_MAX_NEW_TOKENS}")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message through chat templates")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="F", help="read the prompt from a file")
    src.add_argument("--messages-file", metavar="F", help="a JSON list of {role, content} messages (implies chat)")
    p.add_argument("--samples", type=_at_least_one, metavar="N", help="N independent generations, seeds S..S+N-1")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="override the catalog's precision for both models (gguf: the GGUF on llama.cpp)",
    )
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="usd", description="Universal speculative decoding: lossless, any pair.")
    parser.add_argument(
        "--catalog",
        metavar="FILE",
        help="a file of your own model entries, merged over models.yaml (default: $USD_CHAT_MODELS)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch and verify models, converting what this machine's runner reads (idempotent)")
    p.add_argument("names", nargs="*", metavar="NAME", help="catalog names, local paths or hub ids")
    p.add_argument("--all", action="store_true", help="every catalog model")
    p.add_argument("--verify", action="store_true", help="re-hash every cached file, not only changed ones")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="fetch what this precision's runner reads (default: the catalog's choice for this machine): gguf "
        "keeps a GGUF model as it is, any other converts it to float32 safetensors for transformers (once)",
    )
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list the catalog and what is ready locally")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("overlap", help="how much of two vocabularies is shared, compared as raw bytes")
    p.add_argument("target")
    p.add_argument("drafter")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_overlap)

    _generate_arguments(
        sub.add_parser("generate", help="generate with speculative decoding; the answer is exactly the target's")
    )

    from .bench.run import add_arguments

    p = sub.add_parser("bench", help="all algorithms side by side on a prompt set, with speedups and identity")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)

    from .suggest import add_arguments as suggest_arguments

    p = sub.add_parser("suggest", help="rank the drafters on this machine for a target by their expected speedup")
    suggest_arguments(p)
    p.set_defaults(func=cmd_suggest)

    from .bench.projection import add_arguments as project_arguments

    p = sub.add_parser("project", help="expected speedup over k on profiled hardware (theory + measured c and v)")
    project_arguments(p)
    p.set_defaults(func=cmd_project)

    from .serve.main import add_arguments as serve_arguments

    p = sub.add_parser("serve", help="an OpenAI-compatible server (/v1) on the pair, loaded once")
    serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CatalogError, StoreError, LoadError, ValueError) as e:
        print(f"usd {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; what was half-done has been cleaned up by now
        print(f"usd {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
