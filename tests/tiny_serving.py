"""A tiny random pair to serve (`usd serve`'s routes, the app), with a knob that slows its forwards down: the server
tests need generations that last long enough to queue, cancel or disconnect from, without real models."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import tiny_tokenizers as tiny
from tiny_pairs import tiny_pair

from usd.pair import Pair

CONTEXT = 256
"""The tiny models' positions (tiny_pairs.tiny_config)."""


class Slowdown:
    """Sleeps `seconds` before every forward of the model it hooks (0: no delay), and counts the forwards."""

    def __init__(self, model):
        self.seconds = 0.0
        self.forwards = 0
        model.register_forward_pre_hook(self._before)

    def _before(self, *_):
        self.forwards += 1
        if self.seconds:
            time.sleep(self.seconds)


def served_pair() -> tuple[Pair, Slowdown]:
    """A tiny target with a byte-level drafter of other merges (as Qwen with SmolLM2), its context set as
    `usd.load_pair` sets a real one's, and the target's Slowdown."""
    t, d = tiny.target(), tiny.drafter_byte_level()
    target, drafter = tiny_pair(t, d, seed=0)
    pair = Pair(target, t, drafter, d, "tiny-target", "tiny-drafter", context_length=CONTEXT)
    return pair, Slowdown(target)


def new_answer_request(pair: Pair, i: int) -> dict:
    """A chat completion body asking suffix for the i-th of many different short answers (each new to its memory)."""
    return {
        "model": pair.target_name,
        "messages": [{"role": "user", "content": f"request {i}: say {i * 7919 % 100003} again"}],
        "max_tokens": 12,
        "speculative": {"algorithm": "suffix"},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """`app` on a free port of 127.0.0.1, in a thread; yields its root URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def rss_mb() -> float:
    """This process's resident memory in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Bystander:
    """Another client asking `url` every 50 ms: its slowest answer is how long the server's event loop stalled."""

    def __init__(self, url: str, headers: dict | None = None):
        self.url, self.headers = url, headers or {}
        self.worst = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        import httpx

        with httpx.Client(timeout=120, headers=self.headers) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.get(self.url).raise_for_status()
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.answers += 1
                self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(120)
