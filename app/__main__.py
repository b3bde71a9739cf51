"""`python -m app` / `usd-chat`: load the default pair (fetching it on first run) and start the UI on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import sys
from typing import get_args


def create(target: str | None = None, drafter: str | None = None, space: bool | None = None,
           device: str | None = None, precision: str | None = None, log=print):  # fmt: skip
    """Load the pair and build the Blocks (not launched). A pair that fails to load leaves the UI up, saying why."""
    from usd.catalog import load_catalog

    from .pairs import Pairs
    from .space import space_mode
    from .ui import build

    catalog = load_catalog()
    pairs = Pairs(catalog, space_mode() if space is None else space, device=device, precision=precision)
    target, drafter = target or catalog.default.target, drafter or catalog.default.drafter
    try:
        pairs.load(target, drafter, log=log)
    except (ValueError, OSError, RuntimeError) as e:  # LoadError, SpaceModeError, StoreError: say so, keep going
        log(f"usd-chat: could not load {target} + {drafter}: {e}\nThe UI starts without a pair; load one in its "
            "Pair tab.")  # fmt: skip
    return build(pairs), pairs


def launch(demo, host: str, port: int | None, share: bool = False, concurrency: int = 1, max_queue: int = 16,
           **kwargs):  # fmt: skip
    from .ui import CSS_PATH

    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue)
    return demo.launch(server_name=host, server_port=port, share=share, css_paths=[CSS_PATH], **kwargs)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local app
    from usd.catalog import Precision

    parser = argparse.ArgumentParser(prog="usd-chat", description="usd-chat: lossless speculative decoding, any pair")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    parser.add_argument("--share", action="store_true", help="make a public Gradio link (off by default)")
    parser.add_argument("--target", help="target model (catalog name, local path or hub id); default: the catalog's")
    parser.add_argument("--drafter", help="drafter model; default: the catalog's")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--precision", choices=get_args(Precision),
                        help="default: the catalog's choice for the device")
    parser.add_argument("--space", action="store_true", default=None,
                        help="Space mode: only the catalog models the Space serves (USD_CHAT_SPACE_MODELS), no local "
                        "paths (also USD_CHAT_SPACE=1)")
    parser.add_argument("--concurrency", type=int, default=1, help="generations running at once (default 1)")
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting at most; more are turned away")
    args = parser.parse_args(argv)

    from .space import SpaceModelsError

    try:
        demo, _ = create(args.target, args.drafter, args.space, args.device, args.precision)
    except SpaceModelsError as e:  # the deployer's list of served models is wrong: say which name, exit
        parser.error(str(e))
    launch(demo, args.host, args.port, args.share, args.concurrency, args.max_queue)
    return 0


if __name__ == "__main__":
    sys.exit(main())
