"""`python -m app` / `usd-chat`: prepare the default pair and start the UI."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from usd.catalog import load_catalog
    from usd.store import StoreError, pull

    parser = argparse.ArgumentParser(prog="usd-chat", description="usd-chat: lossless speculative decoding, any pair")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="make a public Gradio link (off by default)")
    parser.parse_args(argv)

    catalog = load_catalog()
    try:
        for name in (catalog.default.target, catalog.default.drafter):
            print(f"{name}: ready at {pull(catalog.get(name))}")
    except StoreError as e:
        print(f"usd-chat: {e}", file=sys.stderr)
        return 2
    # The chat UI is built on the engine's event stream (issues 3 and 4); until it lands, this entry point only
    # prepares the default pair so that the first launch of the UI starts at once.
    print("The default pair is ready. The chat UI is not built yet (issue 4); meanwhile try:\n"
          "  usd generate --prompt 'def fibonacci(n):'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
