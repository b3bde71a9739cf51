"""`python -m app` / `usd-chat`: load the default pair (fetching it on first run) and start the UI on 127.0.0.1, with
the OpenAI-compatible /v1 routes on the same pair; or, with --backend, a front end for an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from usd.catalog import NO_DRAFTER as NO_DRAFTER_ARG
from usd.catalog import add_pair_arguments
from usd.hugepages import restart_with_huge_pages
from usd.settings import PRECISIONS

CSS_PATH = Path(__file__).resolve().parent / "app.css"
"""The app's style sheet, inside the package, so that an installed app has it too."""

CACHE_CHECK_S = 3600
"""How often, and past what age, Gradio deletes the files it cached (it has no reason to keep any here)."""
QUEUE_POLL_S = 0.05
"""How often Gradio's queue looks for a job to start, and for progress to send (Gradio's own values on Windows; on
Linux it looks every 1 and 10 ms, idle or not). Each look wakes the app's event loop, which takes the GIL from the
decoding thread and, where the engine fills every core, displaces one of its threads, whose step then waits at its
barrier: docs/benchmarks.md ("The Chat tab against the engine"). A click waits at most this long to start."""


def create(
    target: str | None = None,
    drafter: str | None = None,
    space: bool | None = None,
    device: str | None = None,
    precision: str | None = None,
    log=print,
    api_key: str | None = None,
):
    """Load the pair and build the page (not launched), with the /v1 routes on the same pair (added at launch).
    A pair that fails to load leaves the UI up, saying why."""
    from usd.catalog import load_catalog
    from usd.serve import Slots

    from .pairs import NO_DRAFTER, Pairs
    from .space import gpu, space_mode
    from .ui import build
    from .v1 import AppService

    catalog = load_catalog()
    pairs = Pairs(catalog, space_mode() if space is None else space, device=device, precision=precision)
    target, drafter = target or catalog.default.target, drafter or catalog.default.drafter
    drafter = NO_DRAFTER if drafter == NO_DRAFTER_ARG else drafter
    try:
        pairs.load(target, drafter, log=log)
    except (ValueError, OSError, RuntimeError) as e:  # LoadError, SpaceModeError, StoreError: say so, keep going
        log(
            f"usd-chat: could not load {target} + {drafter}: {e}\nThe UI starts without a pair; load one in its "
            "Pair tab."
        )
    slots = Slots()
    page = build(pairs, slots)
    page.service = AppService(pairs, slots=slots, api_key=_api_key(api_key), wrap=gpu)  # launch() adds its routes
    return page, pairs


def create_front_end(backend: str, api_key: str | None = None, log=print):
    """The page (not launched) as a front end for an OpenAI-compatible server (`backend`, its /v1 URL): no local
    pair, no /v1 of its own. A backend that does not answer yet leaves the UI up, saying why."""
    from usd.catalog import load_catalog

    from . import remote
    from .ui import build

    pairs = remote.RemotePairs(backend, _api_key(api_key), load_catalog())
    try:
        pairs.connect()
    except (ValueError, OSError, RuntimeError) as e:  # LoadError: say so, keep going; it is asked again later
        log(f"usd-chat: {e}\nThe UI starts anyway and asks the backend again at the first request.")
    return build(pairs, stream=remote.stream), pairs


def _api_key(given: str | None) -> str | None:
    """With --backend, the key sent to it; otherwise the key the app's /v1 routes require (default: the variable)."""
    from usd.serve import API_KEY_ENV

    return given if given is not None else os.environ.get(API_KEY_ENV)


def launch(page, host: str, port: int | None, share: bool = False, concurrency: int = 1, max_queue: int = 16, **kwargs):
    """Serve the Blocks with what one visitor may ask of them bounded: every event that runs the models goes through
    Gradio's queue (`api_open=False` closes the REST routes that would skip it, /gradio_api/run/...), no request
    body is over protocol.MAX_BODY_BYTES (`BodyLimit`, also for /v1), and no upload is kept (the app has no file
    input: `max_file_size=0` refuses every file, and what Gradio caches is deleted hourly and at exit)."""
    from starlette.middleware import Middleware

    from usd.serve import BodyLimit, create_router

    from .page import PageScript

    demo = page.demo
    demo.queue(default_concurrency_limit=concurrency, max_size=max_queue, api_open=False)
    # no public setting for these: a Gradio that renames them fails tests/test_app_page.py
    demo._queue.sleep_when_free = demo._queue.progress_update_sleep_when_free = QUEUE_POLL_S
    demo.delete_cache = demo.delete_cache or (CACHE_CHECK_S, CACHE_CHECK_S)
    app_kwargs = dict(kwargs.pop("app_kwargs", None) or {})
    app_kwargs["middleware"] = [*app_kwargs.get("middleware", []), Middleware(BodyLimit), Middleware(PageScript)]
    if page.service is not None:  # the /v1 routes, in Gradio's own FastAPI app from its start, sharing the UI's slots
        page.service.slots.configure(concurrency, max_queue)
        app_kwargs["routes"] = [*app_kwargs.get("routes", []), *create_router(page.service).routes]
    if page.live is not None:  # the live views' own update channel (app/live.py)
        app_kwargs["routes"] = [*app_kwargs.get("routes", []), page.live.route()]
    kwargs["app_kwargs"] = app_kwargs
    kwargs.setdefault("max_file_size", 0)
    return demo.launch(server_name=host, server_port=port, share=share, css_paths=[CSS_PATH], **kwargs)


def main(argv: list[str] | None = None) -> int:
    from usd import suffix
    from usd.serve import API_KEY_ENV, add_memory_argument

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local app

    parser = argparse.ArgumentParser(prog="usd-chat", description="usd-chat: lossless speculative decoding, any pair")
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    parser.add_argument("--share", action="store_true", help="make a public Gradio link (off by default)")
    add_pair_arguments(parser)
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the catalog's choice for the device")
    parser.add_argument(
        "--space",
        action="store_true",
        default=None,
        help="Space mode: only the catalog models the Space serves (USD_CHAT_SPACE_MODELS), no local "
        "paths (also USD_CHAT_SPACE=1)",
    )
    parser.add_argument("--concurrency", type=int, default=1, help="generations running at once (default 1)")
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting at most; more are turned away")
    parser.add_argument(
        "--backend",
        metavar="URL",
        help="be a front end for this OpenAI-compatible server (its /v1 "
        "URL, e.g. http://127.0.0.1:8000/v1) instead of loading a pair",
    )
    parser.add_argument(
        "--api-key",
        help=f"with --backend, the key sent to it; otherwise the key this app's /v1 "
        f"routes require (default: ${API_KEY_ENV}; unset: none)",
    )
    add_memory_argument(parser)
    args = parser.parse_args(argv)
    suffix.MEMORY.resize(args.suffix_memory)

    from .space import SpaceModelsError

    try:
        if args.backend:
            page, _ = create_front_end(args.backend, args.api_key)
        else:
            page, _ = create(args.target, args.drafter, args.space, args.device, args.precision, api_key=args.api_key)
    except SpaceModelsError as e:  # the deployer's list of served models is wrong: say which name, exit
        parser.error(str(e))
    launch(page, args.host, args.port, args.share, args.concurrency, args.max_queue)
    return 0


def run() -> int:
    """The program (`python -m app`, `usd-chat`, the Space): restarted in huge pages where that helps
    (usd/hugepages.py), before anything heavy is imported, then main()."""
    restart_with_huge_pages()
    return main()


if __name__ == "__main__":
    sys.exit(run())
