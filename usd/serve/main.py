"""`usd serve`: load the pair once and serve the OpenAI-compatible /v1 routes with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys

from usd.catalog import add_pair_arguments, drafter_arg
from usd.settings import PRECISIONS

API_KEY_ENV = "USD_API_KEY"


def _positive(value: str) -> int:
    if not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def _not_negative(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value!r}")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument(
        "--api-key", help=f"require this key as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; unset: no key)"
    )
    p.add_argument("--concurrency", type=_positive, default=1, help="generations running at once (default 1)")
    p.add_argument(
        "--max-queue", type=_not_negative, default=16, help="requests waiting at most (default 16); more get 429"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--precision", choices=PRECISIONS, help="override the catalog's precision for both models")
    add_memory_argument(p)


def memory_size(value: str) -> int:
    """--suffix-memory's value in bytes, or a clear error at start."""
    from usd.suffix import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_memory_argument(p: argparse.ArgumentParser) -> None:
    from usd.suffix import DEFAULT_BOUND

    p.add_argument(
        "--suffix-memory",
        type=memory_size,
        default=DEFAULT_BOUND,
        metavar="SIZE",
        help="bytes of earlier answers the suffix drafter keeps, per API key when keyed "
        f"(default {DEFAULT_BOUND >> 20}MiB; 0: none)",
    )


def run_cli(args, catalog) -> int:
    import uvicorn

    from usd import api, suffix

    from .routes import create_app
    from .service import FixedPair
    from .slots import Slots

    def log(message) -> None:
        print(message, file=sys.stderr)

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        log(
            f"usd serve: warning: listening on {args.host} without an API key; anyone who can reach it can use it "
            f"(set --api-key or ${API_KEY_ENV})"
        )
    suffix.MEMORY.resize(args.suffix_memory)
    pair = api.load_pair(
        args.target, drafter_arg(args.drafter), catalog=catalog, device=args.device, precision=args.precision, log=log
    )
    service = FixedPair(pair, slots=Slots(args.concurrency, args.max_queue), api_key=key)
    log(
        f"usd serve: {pair.target_name} + {pair.drafter_name} on http://{args.host}:{args.port}/v1 (model "
        f"{pair.target_name!r}; concurrency {args.concurrency}, queue {args.max_queue}"
        f"{', API key required' if key else ''})"
    )
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    return 0
