"""The Chat tab's speed against the engine's, side by side in one run: tokens/s in a real browser (headless Chromium
driven by Playwright, first token to last as the page shows them) and `usd generate` on the same prompt and settings
(first token to last as its output arrives, and the tokens/s it reports) and the same generation on a worker
thread of a fresh process, as the app decodes, for each algorithm, repeated.

    PYTHONPATH=. python scripts/browser_vs_engine.py --repeats 3 --tokens 256 --json docs/bench/browser-vs-engine.json

The app runs as a user starts it (`python -m app`, the default pair unless --target/--drafter), on this machine, and the
browser renders on the same cores. The first chat after the app starts is an `auto` answer (the first answer of a
freshly loaded pair, reported on its own row; --first names another algorithm for it); then, per repeat, every algorithm
once in the browser, once through `usd generate` and once on a worker thread (fresh processes: their `auto` is always a
first answer after a load), the order of the algorithms alternating from repeat to repeat. Besides the speeds it records
the CPU seconds the app's process and the browser's processes spent per browser answer, and the load average. With
--py-spy, each browser answer is also sampled by py-spy (`py-spy record --format raw`, one file per answer in
--profile-dir): where the app's Python time went.

Nothing is downloaded: the models must be pulled (`usd pull`), and Debian's chromium installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
PROMPT = (
    "Write a Python module that implements a singly linked list class with methods to append, prepend, insert at "
    "an index, delete by value, search, reverse in place, and return its length, with a docstring for every method "
    "and a short usage example at the end."
)
SUMMARY = re.compile(r"\[(\w+): (\d+) tokens in ([\d.]+) s, ([\d.]+) tokens/s")
OBSERVER = """() => {
  const marks = [];
  const shown = () => document.querySelectorAll('#tokens .tok:not(.tok-rejected)').length;
  const record = () => marks.push([performance.now(), shown()]);
  const observer = new MutationObserver(record);
  for (const id of ['#tokens', '#chatbot']) {
    observer.observe(document.querySelector(id), {subtree: true, childList: true, characterData: true});
  }
  window.__usdMarks = marks;
  window.__usdObserver = observer;
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int, args, log_path: Path, root: Path = ROOT) -> subprocess.Popen:
    """The app as a user starts it, from the checkout at `root`, on `port`; back once its page answers."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "USD_CHAT_RECORD": "0"}
    command = [sys.executable, "-m", "app", "--port", str(port)]
    if args.app_threads:  # an experiment: llama.cpp on fewer threads than cores in the app only
        command = [
            sys.executable,
            "-c",
            f"from usd.hugepages import restart_with_huge_pages; restart_with_huge_pages(); "
            f"import sys, usd.runners.llamacpp.model as m; m.cpu_threads = lambda: {args.app_threads}; "
            f"from app.__main__ import main; sys.exit(main(sys.argv[1:]))",
            "--port",
            str(port),
        ]
    for name in ("target", "drafter"):
        if getattr(args, name):
            command += [f"--{name}", getattr(args, name)]
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited: {log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()
            return proc
        except OSError:
            if time.time() > deadline:
                proc.terminate()
                raise SystemExit("the app did not come up within 15 minutes") from None
            time.sleep(2)


def cpu_seconds(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def browser_procs() -> list:
    return [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name().lower()]


class Page:
    """The app's page in headless Chromium, with the settings panel open."""

    def __init__(self, playwright, url: str, tokens: int):
        self.browser = playwright.chromium.launch(
            executable_path=shutil.which("chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.goto(url)
        self.page.locator("#settings").get_by_text("Settings").first.click()
        box = self.page.locator("#max-new-tokens input")
        # Gradio sets the settings' first values again a moment after their accordion opens, over what was typed
        # (tests/test_app.py typed_and_kept): type until it stays
        for _ in range(5):
            box.fill(str(tokens))
            box.press("Tab")
            self.page.wait_for_timeout(500)
            if box.input_value() == str(tokens):
                break
        else:
            raise SystemExit(f"the page did not keep max new tokens at {tokens}")

    def set_algorithm(self, algorithm: str) -> None:
        from playwright.sync_api import expect

        box = self.page.locator("#algorithm input")
        box.click()
        box.fill(algorithm)
        box.press("Enter")
        expect(box).to_have_value(algorithm)

    def chat(self, algorithm: str, prompt: str) -> dict:
        """One answer in a cleared chat: first-token-to-last tokens/s as the page showed them, and its stats."""
        from playwright.sync_api import expect

        page = self.page
        self.set_algorithm(algorithm)
        page.locator("#clear").click()
        expect(page.locator("#tokens .tok")).to_have_count(0, timeout=60_000)
        expect(page.locator("#stats .stop-reason")).to_have_count(0, timeout=60_000)
        page.evaluate(OBSERVER)
        page.locator("#message textarea").fill(prompt)
        t0 = page.evaluate("performance.now()")
        page.locator("#send").click()
        page.wait_for_selector("#stats .stop-reason", timeout=900_000)
        time.sleep(0.5)  # the last update's rendering
        marks = page.evaluate("(() => { window.__usdObserver.disconnect(); return window.__usdMarks; })()")
        cell = page.locator('#stats td[data-stat="tokens · rounds · seconds"]').inner_text()
        tokens = int(cell.split("·")[0])
        shown = [(t, n) for t, n in marks if n > 0]
        n_last = max(n for _, n in shown)
        t_first, n_first = shown[0]
        t_last = next(t for t, n in shown if n == n_last)
        return {
            "tokens": tokens,
            "shown": n_last,
            "first_token_s": (t_first - t0) / 1e3,
            "tokens_per_s": (n_last - n_first) / ((t_last - t_first) / 1e3) if t_last > t_first else None,
            "updates": len({round(t) for t, _ in shown}),
            "stats": page.locator("#stats").inner_text(),
        }


def engine(algorithm: str, prompt: str, tokens: int, args) -> dict:
    """`usd generate` in a fresh process: first token to last as its output arrives, and the tokens/s it reports."""
    command = [sys.executable, "-m", "usd", "generate", "--chat", "--algorithm", algorithm]
    command += ["--max-new-tokens", str(tokens), "--prompt", prompt]
    for name in ("target", "drafter"):
        if getattr(args, name):
            command += [f"--{name}", getattr(args, name)]
    env = {**os.environ, "USD_CHAT_RECORD": "0"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.start()
    chunks = []
    while os.read(proc.stdout.fileno(), 65536):
        chunks.append(time.perf_counter())
    proc.wait()
    reader.join()
    stderr = b"".join(err).decode()
    found = SUMMARY.search(stderr)
    if proc.returncode or not found:
        raise SystemExit(f"usd generate failed: {stderr[-2000:]}")
    n = int(found.group(2))
    return {
        "tokens": n,
        "tokens_per_s": float(found.group(4)),
        "first_to_last_tokens_per_s": (n - 1) / (chunks[-1] - chunks[0]) if len(chunks) > 1 else None,
        "load_1min": os.getloadavg()[0],
    }


def engine_on_a_thread(algorithm: str, prompt: str, tokens: int, args) -> dict:
    """The same generation in a fresh process through the Python API on a worker thread, as the app runs it (a
    thread other than the loading one once decoded far slower: docs/benchmarks.md, "llama.cpp on its own threads"):
    first token to last from the rounds' own times."""
    command = [sys.executable, __file__, "--worker-engine", algorithm, "--tokens", str(tokens), "--prompt", prompt]
    for name in ("target", "drafter"):
        if getattr(args, name):
            command += [f"--{name}", getattr(args, name)]
    env = {**os.environ, "USD_CHAT_RECORD": "0"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the worker-thread engine failed: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_1min": os.getloadavg()[0]}


def worker_engine(args) -> None:
    """--worker-engine: load the pair as `usd generate` does (restarted in huge pages, as `usd` is), generate once on
    a worker thread, print the times."""
    from usd.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    import usd
    from usd.chat import user_turn

    pair = usd.load_pair(args.target, args.drafter if args.worker_engine != "none" else False, log=lambda *_: None)
    times: list[tuple[float, int]] = []
    done = []

    def run():
        for event in usd.stream(
            pair, messages=user_turn(args.prompt), algorithm=args.worker_engine, max_new_tokens=args.tokens
        ):
            if isinstance(event, usd.Finished):
                done.append(event)
            elif event.emitted:
                times.append((time.perf_counter(), len(event.emitted)))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    (t_first, n_first), (t_last, _) = times[0], times[-1]
    n = done[0].stats.tokens
    rate = (n - n_first) / (t_last - t_first) if t_last > t_first else None
    print(json.dumps({"tokens": n, "tokens_per_s": done[0].stats.tokens_per_s, "first_to_last_tokens_per_s": rate}))


def profiled(args, pid: int, name: str):
    """py-spy sampling the app while a browser answer runs (or nothing, without --py-spy)."""
    if not args.py_spy:
        return None
    out = Path(args.profile_dir) / f"{name}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "50", "--output", str(out)]
    return subprocess.Popen([*cmd, "--threads", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def browser_answer(page: Page, app: psutil.Process, algorithm: str, args, name: str) -> dict:
    spy = profiled(args, app.pid, name)
    before_app, before_browser = cpu_seconds([app]), cpu_seconds(browser_procs())
    out = page.chat(algorithm, args.prompt)
    out["app_cpu_s"] = cpu_seconds([app]) - before_app
    out["browser_cpu_s"] = cpu_seconds(browser_procs()) - before_browser
    out["load_1min"] = os.getloadavg()[0]  # other work on the machine: the numbers are only as quiet as this
    if spy is not None:
        spy.send_signal(2)  # SIGINT: py-spy writes its samples and exits
        spy.wait(timeout=60)
    return out


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(runs: list, side: str) -> float | None:
    """The median over the repeats of browser / `side`, each repeat's pair measured next to each other."""
    return median(
        r["browser"]["tokens_per_s"] / r[side]["first_to_last_tokens_per_s"]
        for r in runs
        if r["browser"]["tokens_per_s"] and r[side]["first_to_last_tokens_per_s"]
    )


def table(results: dict, algorithms: list[str]) -> str:
    lines = [
        "| algorithm | browser tok/s | `usd generate` tok/s | browser / `usd generate` | engine on a worker thread "
        "tok/s | browser / worker thread | app CPU s | browser CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = results.get("first")
    if first:
        lines.append(
            f"| {first['algorithm']}, the first answer after start | {first['tokens_per_s']:.1f} | | | | | "
            f"{first['app_cpu_s']:.1f} | {first['browser_cpu_s']:.1f} |"
        )
    for algorithm in algorithms:
        runs = results["runs"][algorithm]
        b = median(r["browser"]["tokens_per_s"] for r in runs)
        e = median(r["engine"]["first_to_last_tokens_per_s"] for r in runs)
        w = median(r["thread"]["first_to_last_tokens_per_s"] for r in runs)
        app_cpu = median(r["browser"]["app_cpu_s"] for r in runs)
        browser_cpu = median(r["browser"]["browser_cpu_s"] for r in runs)
        lines.append(
            f"| {algorithm} | {b:.1f} | {e:.1f} | {ratio(runs, 'engine'):.2f}x | {w:.1f} | "
            f"{ratio(runs, 'thread'):.2f}x | {app_cpu:.1f} | {browser_cpu:.1f} |"
        )
    loads = [
        r[side]["load_1min"] for a in algorithms for r in results["runs"][a] for side in ("browser", "engine", "thread")
    ]
    lines.append(f"\n1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f} ({os.cpu_count()} cores)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--algorithms", nargs="+", default=["none", "auto"])
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--first", default="auto", help="the algorithm of the first answer after start (default auto)")
    ap.add_argument("--no-first", action="store_true", help="skip the first answer after start")
    ap.add_argument("--app-threads", type=int, help="llama.cpp threads in the app (default: one per core)")
    ap.add_argument("--py-spy", help="path to py-spy: sample the app during each browser answer")
    ap.add_argument("--profile-dir", default="/tmp/usd-browser-profile")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--screenshot", help="save the page here after each speculative answer (README's picture)")
    ap.add_argument("--worker-engine", metavar="ALGORITHM", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_engine:
        worker_engine(args)
        return 0
    if not shutil.which("chromium"):
        raise SystemExit("Debian's chromium is needed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    port = free_port()
    log_path = Path(args.profile_dir) / "app.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = start_app(port, args, log_path)
    app = psutil.Process(proc.pid)
    results: dict = {"prompt": args.prompt, "tokens": args.tokens, "runs": {a: [] for a in args.algorithms}}
    try:
        with sync_playwright() as p:
            page = Page(p, f"http://127.0.0.1:{port}/", args.tokens)
            if not args.no_first:
                results["first"] = browser_answer(page, app, args.first, args, f"first-{args.first}")
                results["first"]["algorithm"] = args.first
                print(
                    f"first {args.first} answer after start: {results['first']['tokens_per_s']:.1f} tok/s", flush=True
                )
            for i in range(args.repeats):
                order = args.algorithms if i % 2 == 0 else args.algorithms[::-1]
                for algorithm in order:
                    b = browser_answer(page, app, algorithm, args, f"{algorithm}-{i}")
                    if args.screenshot and algorithm != "none":  # the last speculative answer, as README shows it
                        page.page.screenshot(path=args.screenshot)
                    e = engine(algorithm, args.prompt, args.tokens, args)
                    w = engine_on_a_thread(algorithm, args.prompt, args.tokens, args)
                    results["runs"][algorithm].append({"browser": b, "engine": e, "thread": w})
                    print(
                        f"{algorithm} #{i}: browser {b['tokens_per_s']:.1f} tok/s ({b['tokens']} tokens, "
                        f"{b['updates']} updates, app CPU {b['app_cpu_s']:.1f} s, browser CPU "
                        f"{b['browser_cpu_s']:.1f} s); usd generate {e['first_to_last_tokens_per_s']:.1f} tok/s "
                        f"first to last ({e['tokens_per_s']:.1f} as it reports); on a worker thread "
                        f"{w['first_to_last_tokens_per_s']:.1f}",
                        flush=True,
                    )
            page.browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(table(results, args.algorithms))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
