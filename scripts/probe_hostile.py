"""Hostile requests against a running `usd serve` and a running app, each timed while another client asks
`GET /v1/models` (or the app's `/config`) every 50 ms: how long the hostile request took, what it got, and the worst
wait of the bystander (the event loop's stall). With --pid, the server's RSS before, at its peak, and after.

    usd serve --target qwen2.5-coder-0.5b-instruct --drafter smollm2-135m-instruct --port 7890 &
    PYTHONPATH=. python scripts/probe_hostile.py serve http://127.0.0.1:7890 --pid $!
    python -m app --port 7891 --concurrency 1 --max-queue 4 &
    PYTHONPATH=. python scripts/probe_hostile.py app http://127.0.0.1:7891 --pid $!

The loops are bounded (at most a few dozen requests); every number is one run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

MiB = 1 << 20


def rss_mib(pid: int | None) -> tuple[float, float] | None:
    """(current RSS, peak RSS) of `pid` in MiB, from /proc."""
    if pid is None:
        return None
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class Bystander:
    """Another client, asking `url` every 50 ms while the hostile request runs: its slowest answer is the stall."""

    def __init__(self, url: str):
        self.url, self.worst, self.stop = url, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                client.get(self.url)
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.stop.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def probe(name: str, bystander_url: str, pid: int | None, hostile: Callable[[], str]) -> dict:
    before = rss_mib(pid)
    t0 = time.perf_counter()
    with Bystander(bystander_url) as b:
        outcome = hostile()
    took = time.perf_counter() - t0
    time.sleep(1)
    after = rss_mib(pid)
    row = {"probe": name, "outcome": outcome, "took_s": round(took, 2), "bystander_worst_s": round(b.worst, 3)}
    if before and after:
        row |= {"rss_before_mib": round(before[0]), "rss_peak_mib": round(after[1]), "rss_after_mib": round(after[0])}
    print(json.dumps(row), flush=True)
    return row


def post(url: str, body: dict | bytes, timeout: float = 900) -> str:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)
    try:
        message = r.json().get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        message = r.text
    return f"{r.status_code} {str(message)[:90]}"


def in_parallel(n: int, fn: Callable[[int], str]) -> str:
    results: list[str] = [""] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts: dict[str, int] = {}
    for r in results:
        counts[r[:40]] = counts.get(r[:40], 0) + 1
    return "; ".join(f"{k} x{v}" for k, v in counts.items())


def serve_probes(base: str, pid: int | None, big_mb: int) -> None:
    v1 = f"{base}/v1"
    model = httpx.get(f"{v1}/models", timeout=30).json()["data"][0]["id"]
    models = f"{v1}/models"
    ask = {"model": model, "prompt": "def add(a, b):", "max_tokens": 8}
    probe("stop 0.5 MB", models, pid, lambda: post(f"{v1}/completions", {**ask, "stop": "ab" * (MiB // 4)}))
    probe(
        "stop 0.5 MB, streamed",
        models,
        pid,
        lambda: post(f"{v1}/completions", {**ask, "stream": True, "stop": "ab" * (MiB // 4)}),
    )
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "a " * (big_mb * MiB // 2)}]})
    probe(f"chat body {big_mb} MB", models, pid, lambda: post(f"{v1}/chat/completions", body.encode()))
    prompt = {"model": model, "prompt": "word " * (2 * MiB // 5), "max_tokens": 4}
    probe("ten 2 MB prompts at once", models, pid, lambda: in_parallel(10, lambda i: post(f"{v1}/completions", prompt)))
    # no letters or digits: the cheap bounds let it through, so it is tokenized whole
    marks = {**prompt, "prompt": ", " * (MiB // 2)}
    probe(
        "ten 1 MB prompts of commas", models, pid, lambda: in_parallel(10, lambda i: post(f"{v1}/completions", marks))
    )


def app_probes(base: str, pid: int | None, compare_tokens: int) -> None:
    from gradio_client import Client

    config = f"{base}/config"
    ui = Client(base, verbose=False)

    def generate_s() -> float:
        t0 = time.perf_counter()
        ui.predict(prompt="Hi", max_new_tokens=4, api_name="/generate")
        return time.perf_counter() - t0

    def cancel_compare() -> str:
        alone = generate_s()  # the same request with nothing before it, for scale on a busy machine
        job = ui.submit(
            prompt="Count from 1 to 400, one number per line.",
            temperature=0,
            max_new_tokens=compare_tokens,
            api_name="/compare",
        )
        time.sleep(6)
        job.cancel()
        return f"next /generate answered {generate_s():.1f} s after the cancel ({alone:.1f} s alone)"

    probe("cancel /compare", config, pid, cancel_compare)

    def direct(i: int) -> str:
        body = {"data": ["Hi", "", "", "none", "auto", 0, 1, 0, None, 2]}
        r = httpx.post(f"{base}/gradio_api/run/generate", json=body, timeout=900)
        return str(r.status_code)

    probe("12 direct POSTs to /gradio_api/run/generate", config, pid, lambda: in_parallel(12, direct))

    def upload() -> str:
        r = httpx.post(f"{base}/gradio_api/upload", files={"files": ("x.bin", b"\0" * (16 * MiB))}, timeout=120)
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:80]}"
        (path,) = r.json()
        served = httpx.get(f"{base}/gradio_api/file={path}", timeout=60)
        return f"200, stored at {path}, served back: {served.status_code} ({len(served.content) / MiB:.0f} MiB)"

    probe("upload 16 MB", config, pid, upload)
    v1 = f"{base}/v1"
    model = httpx.get(f"{v1}/models", timeout=30).json()["data"][0]["id"]
    ask = {"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "stop": "ab" * (MiB // 4)}
    probe("/v1 stop 0.5 MB", config, pid, lambda: post(f"{v1}/completions", ask))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["serve", "app"])
    parser.add_argument("url", help="the server's root, e.g. http://127.0.0.1:7890")
    parser.add_argument("--pid", type=int, help="the server's process id, for its RSS")
    parser.add_argument("--big-mb", type=int, default=30, help="size of the oversized chat body (default 30)")
    parser.add_argument("--compare-tokens", type=int, default=300, help="max new tokens of the cancelled compare")
    args = parser.parse_args()
    base = args.url.rstrip("/")
    if args.kind == "serve":
        serve_probes(base, args.pid, args.big_mb)
    else:
        app_probes(base, args.pid, args.compare_tokens)


if __name__ == "__main__":
    main()
