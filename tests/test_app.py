"""The app launched for real on 127.0.0.1 with the default pair, driven by gradio_client and by a headless browser."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import usd
from usd.chat import user_turn

pytestmark = pytest.mark.real_models
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that returns the square of a number."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(real_paths):
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    from app.__main__ import create, launch

    page, pairs = create(log=lambda *_: None)
    demo = page.demo
    assert pairs.loaded is not None, "the default pair must load"
    port = free_port()
    launch(page, "127.0.0.1", port, concurrency=1, max_queue=16, prevent_thread_lock=True, quiet=True)
    yield demo, pairs, f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def client(app):
    from gradio_client import Client

    return Client(app[2], verbose=False)


def plain_greedy(pairs, prompt: str, n: int) -> str:
    return usd.generate(pairs.current(), messages=user_turn(prompt), algorithm="none", max_new_tokens=n).text


def test_generate_streams_and_ends_with_the_targets_own_greedy_answer(app, client):
    _, pairs, _ = app
    # tli, not auto: auto remembers across answers that speculation does not pay on a CPU and may then not draft
    # The first update goes out at once (app/views.py, in_background): a streamed answer shows a strict prefix before
    # its end, however fast this machine decodes 48 tokens
    job = client.submit(prompt=PROMPT, algorithm="tli", max_new_tokens=48, api_name="/generate")
    updates = list(job)
    text, pieces, stats = job.result()
    assert len(updates) >= 2 and len(updates[0][0]) < len(text), "the answer must stream"
    assert text == plain_greedy(pairs, PROMPT, 48)
    assert all(u[0] == text[: len(u[0])] for u in updates), "every update is a prefix of the answer"
    assert {p["kind"] for p in pieces} <= {"accepted", "rejected", "resampled", "bonus", "target"}
    assert any(p["kind"] == "accepted" for p in pieces)
    assert all(isinstance(p["round"], int) and isinstance(p["text"], str) for p in pieces)
    assert "".join(p["text"] for p in pieces if p["kind"] != "rejected") == text
    for key in ("acceptance_rate", "tokens_per_round", "tokens_per_s", "wall_s"):
        assert isinstance(stats[key], float) and stats[key] > 0, key
    assert stats["tokens"] == 48 and stats["stop_reason"] == "max_tokens"


def test_the_loaded_pairs_preview_reads_neither_tokenizer_nor_alignment_again(app, monkeypatch):
    # the page asks for it as it opens, next to the first answer: worked out at load from what the pair holds
    from app import pairs as app_pairs

    _, pairs, _ = app
    if pairs.loaded.drafter == app_pairs.NO_DRAFTER:
        pytest.skip("the loaded pair has no drafter: no overlap line")
    monkeypatch.setattr(app_pairs, "load_tokenizer", lambda *a: pytest.fail("a tokenizer read again"))
    monkeypatch.setattr(app_pairs, "overlap_numbers", lambda *a, **k: pytest.fail("the vocabularies aligned again"))
    assert "shared tokens" in pairs.preview(pairs.loaded.target, pairs.loaded.drafter)


def test_compare_reports_identical_greedy_outputs(client):
    plain, speculative, summary = client.predict(
        prompt=PROMPT, algorithm="slem", draft_tokens="4", temperature=0, max_new_tokens=24, api_name="/compare"
    )
    assert summary["identical"] is True and plain == speculative and plain
    assert summary["plain_s"] > 0 and summary["speculative_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["plain_s"] / summary["speculative_s"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": "   "}, "the prompt is empty"),
        ({"prompt": "word " * 40_000}, "longer than .*'s context of [0-9,]+ tokens"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max new tokens must be a whole number from 1 to 4,096"),
        ({"prompt": "hi", "max_new_tokens": 100_000}, "max new tokens must be a whole number from 1 to 4,096"),
        ({"prompt": "hi", "max_new_tokens": "inf"}, "max new tokens must be a whole number from 1 to 4,096, got 'inf'"),
        ({"prompt": 123}, "the prompt must be text, got a number"),
        ({"prompt": "hi", "target": "no-such-model"}, "unknown target"),
        ({"prompt": "hi", "drafter": "/no/such/dir"}, "unknown drafter"),
        ({"prompt": "hi", "algorithm": "fastest"}, "unknown algorithm"),
        ({"prompt": "hi", "algorithm": "standard"}, "standard"),
        ({"prompt": "hi", "draft_tokens": "99"}, "draft tokens must be auto or a whole number from 1 to 16"),
    ],
)
def test_bad_input_gets_a_clear_message_and_the_pair_stays(app, client, kwargs, message):
    from gradio_client.exceptions import AppError

    _, pairs, _ = app
    before = pairs.pair
    with pytest.raises(AppError, match=message.replace("(", r"\(")) as err:
        client.predict(**kwargs, api_name="/generate")
    assert "Traceback" not in str(err.value)
    assert pairs.pair is before


def test_failed_load_keeps_the_previous_pair_usable(app, client, tmp_path):
    from gradio_client.exceptions import AppError

    _, pairs, _ = app
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    before, loaded = pairs.pair, pairs.loaded
    with pytest.raises(AppError):
        client.predict(prompt="hi", drafter=str(broken), max_new_tokens=2, api_name="/generate")
    assert pairs.pair is before and pairs.loaded == loaded
    text, _, _ = client.predict(prompt="Say hello.", max_new_tokens=4, api_name="/generate")
    assert text == plain_greedy(pairs, "Say hello.", 4)


def test_the_queue_is_bounded_and_limits_model_work(app):
    demo = app[0]
    assert demo._queue.max_size == 16
    models = [fn for fn in demo.fns.values() if fn.concurrency_id == "models"]
    assert len(models) >= 5 and all(fn.concurrency_limit == "default" for fn in models)
    assert demo._queue.default_concurrency_limit == 1


def test_eight_clients_at_once_each_get_their_own_answer(app):
    from gradio_client import Client

    _, pairs, url = app
    prompts = [f"Write the number {n} in words, then stop." for n in range(8)]
    results: dict[int, tuple] = {}

    def ask(i: int) -> None:
        c = Client(url, verbose=False)
        job = c.submit(prompt=prompts[i], max_new_tokens=8, api_name="/generate")
        updates = [u[0] for u in job]
        results[i] = (job.result()[0], updates)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(8))
    for i, (text, updates) in results.items():
        assert text == plain_greedy(pairs, prompts[i], 8), f"client {i} got another answer"
        assert all(text.startswith(u) for u in updates), f"client {i} saw another stream"


def open_page(playwright):
    """Debian's chromium, headless, with nothing reaching out of this machine; a page at the screenshot's size."""
    browser = playwright.chromium.launch(
        executable_path=shutil.which("chromium"),
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    )
    return browser, browser.new_page(viewport={"width": 1400, "height": 1000})


def typed_and_kept(page, box, value: str, tries: int = 5) -> None:
    """Type `value` into a settings box and see that it stays. Gradio mounts the settings when their accordion first
    opens and, a moment later, hands each component the value it was built with once more: text typed in between is
    overwritten (seen a few ms after the opening, on one try in four here; once in a CI run, where an answer then
    ran to its end instead of the 48 tokens asked). A person does not type that fast; a test does."""
    for _ in range(tries):
        box.fill(value)
        box.press("Tab")
        page.wait_for_timeout(500)
        if box.input_value() == value:
            return
    raise AssertionError(f"the settings box did not keep {value!r} after {tries} tries")


def choose(page, algorithm: str, max_new_tokens: int):
    """Open the settings and set the algorithm and the answer's length; the length's box, to change it again."""
    from playwright.sync_api import expect

    page.locator("#settings").get_by_text("Settings").first.click()
    max_new = page.locator("#max-new-tokens input")
    typed_and_kept(page, max_new, str(max_new_tokens))
    menu = page.locator("#algorithm input")
    for _ in range(5):  # the same late re-set as typed_and_kept's can put the menu back to its first value
        menu.click()
        menu.fill(algorithm)
        menu.press("Enter")
        expect(menu).to_have_value(algorithm)
        page.wait_for_timeout(500)
        if menu.input_value() == algorithm:
            return max_new
    raise AssertionError(f"the algorithm menu did not keep {algorithm!r}")


def rounds_in_stats(page) -> int:
    return int(page.locator('#stats td[data-stat="tokens · rounds · seconds"]').inner_text().split("·")[1])


def chart_points(page) -> int:
    """The points of the chart's line of emitted tokens: one per round drawn."""
    return len((page.locator("#chart polyline.emitted").get_attribute("points") or "").split())


@pytest.mark.skipif(
    not shutil.which("chromium") and not os.environ.get("USD_CHAT_REQUIRE_BROWSER"),
    reason="Debian's chromium is installed by .ci/run and ./dev.sh test (.ci/run requires it)",
)
def test_browser_chat_shows_coloured_tokens_stats_and_stop_keeps_the_chat(app):
    from playwright.sync_api import expect, sync_playwright

    url = app[2]
    with sync_playwright() as p:
        browser, page = open_page(p)
        channel_reads = []  # the live view's updates over the app's own channel (app/live.py)
        page.on("request", lambda r: channel_reads.append(r.url) if "/usd/live/" in r.url else None)
        page.goto(url)
        # slem drafts every round (auto may have learned from earlier tests that plain decoding is faster here)
        max_new = choose(page, "slem", 48)
        box = page.locator("#message textarea")
        # a message that cannot be answered (here a bad seed) goes back into the box, which sending had emptied
        seed = page.locator("#seed textarea")
        seed.fill("not a number")
        seed.press("Tab")
        box.fill("Hello?")
        box.press("Enter")
        toast = page.get_by_test_id("toast-body")
        expect(toast).to_contain_text("seed must be a whole number", timeout=30_000)
        expect(box).to_have_value("Hello?", timeout=30_000)
        expect(page.locator("#chatbot")).not_to_contain_text("Hello?")
        page.get_by_test_id("toast-close").click()
        seed.fill("")
        seed.press("Tab")
        # Enter sends, Shift+Enter breaks the line (the box says "press Enter or Send")
        box.fill("Write a Python function that checks whether a number is prime.")
        box.press("Shift+Enter")
        box.press_sequentially("Keep it short.")
        expect(box).to_have_value("Write a Python function that checks whether a number is prime.\nKeep it short.")
        expect(page.locator("#chatbot")).not_to_contain_text("prime")  # nothing sent yet
        box.press("Enter")
        expect(page.locator("#chatbot")).to_contain_text("Keep it short.", timeout=60_000)
        expect(box).to_have_value("")
        page.wait_for_selector("#stats .stop-reason", timeout=240_000)
        assert page.locator("#tokens .tok").count() >= 10
        assert page.locator("#tokens .tok-accepted").count() >= 1, "the drafter should get something right"
        expect(page.locator("#stats")).to_contain_text("stopped: max_tokens")
        tps = page.locator('#stats td[data-stat="tokens/s"]').inner_text()
        assert float(tps) > 0
        assert chart_points(page) == rounds_in_stats(page)  # the chart is drawn whole at the end
        expect(page.locator("#chatbot")).to_contain_text("def")
        assert channel_reads, "the live view should read its updates from the app's channel, not Gradio's queue"
        page.screenshot(path=str(ROOT / "assets" / "screenshot.png"), full_page=True)

        # A second turn, stopped mid-stream: the first turn and the partial answer stay.
        max_new.fill("400")
        max_new.press("Tab")
        page.locator("#message textarea").fill("Now explain, step by step and at length, how it works.")
        page.locator("#send").click()
        expect(page.locator("#stats .stop-reason")).to_have_count(0, timeout=60_000)  # the new answer has started
        time.sleep(1)  # within the chart's interval of its first drawing (app/views.py CHART_MS)
        page.locator("#stop").click()
        expect(page.locator("#stats")).to_contain_text("stopped: cancelled", timeout=60_000)
        assert chart_points(page) == rounds_in_stats(page), "the chart is drawn whole at the end, however soon"
        chat = page.locator("#chatbot")
        expect(chat).to_contain_text("[stopped]")
        expect(chat).to_contain_text("checks whether a number is prime")
        expect(chat).to_contain_text("explain, step by step")

        # The Pair tab: the numbers before loading, and a failed load that keeps the pair.
        page.get_by_role("tab", name="Pair").click()
        expect(page.locator("#pair-preview")).to_contain_text("Alpha ceiling for tli", timeout=60_000)
        expect(page.locator("#pair-preview")).to_contain_text("GiB")
        page.get_by_label("…or a drafter hub id / local path").fill("/no/such/model")
        page.locator("#load").click()
        expect(page.locator("#load-status")).to_contain_text("Could not load", timeout=60_000)
        expect(page.locator("#load-status")).to_contain_text("still usable")
        expect(page.locator("#pair-header")).to_contain_text("smollm2-135m-instruct")
        # back in the Chat tab, the token view still holds the last answer (it is appended to, not redrawn)
        page.get_by_role("tab", name="Chat").click()
        expect(page.locator("#tokens .tok").first).to_be_visible()
        browser.close()


@pytest.mark.skipif(
    not shutil.which("chromium") and not os.environ.get("USD_CHAT_REQUIRE_BROWSER"),
    reason="Debian's chromium is installed by .ci/run and ./dev.sh test (.ci/run requires it)",
)
def test_browser_chat_marks_the_tokens_the_n_gram_lookup_drafted(app):
    """ngram on an answer that copies the message (issue 25 point 5): the tokens it looked up are marked apart from
    the drafter model's, and say on hover where in the conversation they were copied from."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = open_page(p)
        page.goto(app[2])
        choose(page, "ngram", 64)
        page.locator("#message textarea").fill(COPYING)
        page.locator("#send").click()
        page.wait_for_selector("#stats .stop-reason", timeout=240_000)
        looked_up = page.locator("#tokens .tok-lookup")
        shown = f"stats: {page.locator('#stats').inner_text()!r}; tokens: {page.locator('#tokens').inner_text()!r}"
        assert looked_up.count() >= 5, f"the answer copies the function: the lookup should draft much of it ({shown})"
        assert "copied from position" in (looked_up.first.get_attribute("title") or "")
        assert "drafted by ngram" in (looked_up.first.get_attribute("title") or "")
        page.locator("#tokens").screenshot(path=str(ROOT / "assets" / "ngram-tokens.png"))
        browser.close()


@pytest.mark.skipif(
    not shutil.which("chromium") and not os.environ.get("USD_CHAT_REQUIRE_BROWSER"),
    reason="Debian's chromium is installed by .ci/run and ./dev.sh test (.ci/run requires it)",
)
def test_browser_compare_tab_streams_both_columns_and_ends_identical(app):
    """The Compare tab's columns stream over the app's channel like the chat's live view, and end whole: the same
    tokens in both columns (greedy), which the summary says."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser, page = open_page(p)
        channel_reads = []
        page.on("request", lambda r: channel_reads.append(r.url) if "/usd/live/" in r.url else None)
        page.goto(app[2])
        choose(page, "slem", 32)
        page.get_by_role("tab", name="Compare").click()
        page.locator("#compare-prompt textarea").fill(PROMPT)
        page.locator("#compare-run").click()
        expect(page.locator("#compare-summary")).to_contain_text("token-identical", timeout=240_000)
        plain = page.locator("#compare-plain-tokens .tok").all_inner_texts()
        spec = page.locator("#compare-speculative-tokens .tok:not(.tok-rejected)").all_inner_texts()
        expect(page.locator("#compare-speculative-head")).to_contain_text("done")
        browser.close()
    assert len(plain) >= 10 and "".join(plain) == "".join(spec)
    assert len(channel_reads) >= 2, "each column reads its updates from a channel of its own"


@pytest.mark.skipif(
    not shutil.which("chromium") and not os.environ.get("USD_CHAT_REQUIRE_BROWSER"),
    reason="Debian's chromium is installed by .ci/run and ./dev.sh test (.ci/run requires it)",
)
def test_browser_a_page_draws_almost_no_frames_idle_or_while_an_answer_streams(app, tmp_path):
    """The page's own animations run on the cores the engine needs. Gradio's status trackers time their label in a
    requestAnimationFrame loop, 60 frames a second, idle or not (app/page.py slows it); a loader shown once, even for
    an instant (the page's own loading screen), animated on for seconds after it was gone, into a first answer sent
    soon after the page opened (app/page.py slows it too). Counted in Chromium's own trace."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser, page = open_page(p)
        page.goto(app[2])
        page.wait_for_selector("#send")
        time.sleep(1)  # the page's first frames (the loading screen, the tabs) end; a user may send this soon
        idle = animation_frames(browser, page, tmp_path / "idle.json", 2)
        choose(page, "none", 400)
        page.locator("#clear").click()
        page.locator("#message textarea").fill("Explain, step by step and at length, how a hash table works.")
        page.locator("#send").click()
        expect(page.locator("#tokens .tok").first).to_be_visible(timeout=60_000)  # the answer streams
        streaming = animation_frames(browser, page, tmp_path / "streaming.json", 2)
        running = page.locator("#stats .stop-reason").count() == 0
        page.locator("#stop").click()
        browser.close()
    assert idle < 20, f"{idle} animation frames in 2 s of an idle page"
    assert running, "the answer ended before its frames were counted: ask for a longer one"
    assert streaming < 20, f"{streaming} animation frames in 2 s of a streaming answer"


def animation_frames(browser, page, trace: Path, seconds: float) -> int:
    """requestAnimationFrame callbacks the page ran in `seconds`, from Chromium's trace."""
    import json

    browser.start_tracing(page=page, path=str(trace), categories=["devtools.timeline"])
    time.sleep(seconds)
    browser.stop_tracing()
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return sum(1 for e in events if e.get("name") == "FireAnimationFrame")


COPYING = (
    "Rename the function below to `total` and change nothing else. Reply with the code only.\n\n"
    "```python\ndef add_all(numbers):\n    result = 0\n    for n in numbers:\n        result += n\n"
    "    return result\n```"
)


@pytest.mark.skipif(
    not shutil.which("chromium") and not os.environ.get("USD_CHAT_REQUIRE_BROWSER"),
    reason="Debian's chromium is installed by .ci/run and ./dev.sh test (.ci/run requires it)",
)
def test_browser_pair_tab_ranks_drafters_and_loads_the_picked_pair(app):
    """The Pair tab's ranking measures the drafters on disk for real (tests/test_suggest.py checks the handler on
    given numbers). It loads smollm2 back, so the pair the next test switches from is still the default."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser, page = open_page(p)
        page.goto(app[2])
        page.get_by_role("tab", name="Pair").click()
        page.locator("#rank").get_by_text("Rank drafters for this target").first.click()
        page.locator("#rank-run").click()
        table = page.locator("#rank-table")
        expect(table).to_contain_text("(plain decoding)", timeout=420_000)
        expect(table).to_contain_text("smollm2-135m-instruct")
        expect(table).to_contain_text("gemma-3-270m")
        expect(table).to_contain_text("qwen2.5-coder-0.5b-instruct")  # the same tokenizer: standard
        expect(page.locator("#rank-status")).to_contain_text("Ranked 3 drafter(s)")
        expect(page.locator("#rank-chart")).to_be_visible()
        page.locator("#rank").screenshot(path=str(ROOT / "assets" / "pair-tab-ranking.png"))
        page.locator("#rank-pick input").click()
        page.locator("#rank-pick input").fill("smollm2-135m-instruct")
        page.locator("#rank-pick input").press("Enter")
        page.locator("#rank-load").click()
        expect(page.locator("#load-status")).to_contain_text("✔", timeout=120_000)
        expect(page.locator("#pair-header")).to_contain_text("smollm2-135m-instruct")
        browser.close()


def test_switching_pairs_frees_the_old_models(app, client):
    """Last in this module: it leaves the Qwen + Gemma pair loaded."""
    import gc
    import weakref

    _, pairs, _ = app
    old = weakref.ref(pairs.pair.drafter)
    text, _, _ = client.predict(prompt="Say hello.", drafter="gemma-3-270m", max_new_tokens=6, api_name="/generate")
    assert pairs.loaded.drafter == "gemma-3-270m"
    assert text == plain_greedy(pairs, "Say hello.", 6)
    gc.collect()
    assert old() is None, "the old drafter is still referenced after the switch"


def test_the_space_entry_point_runs_as_a_space_runs_it(tmp_path, real_paths):
    """`python space_app.py` from the repository root, in Space mode: serves, and refuses paths outside the catalog."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    port = free_port()
    env = {
        **os.environ,
        "USD_CHAT_SPACE": "1",
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "USD_CHAT_SPACE_MODELS": "",
    }
    log = open(tmp_path / "space.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "space_app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        client = None
        while client is None:
            assert proc.poll() is None, (tmp_path / "space.log").read_text()[-3000:]
            assert time.time() < deadline, "the Space app did not come up"
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            except Exception:
                time.sleep(2)
        with pytest.raises(AppError, match="this Space serves only its catalog models"):
            client.predict(prompt="hi", drafter=str(tmp_path), api_name="/generate")
        # a catalog model the Space does not serve (not listed, not on disk) is refused by name, not downloaded
        with pytest.raises(AppError, match=r"target 'qwen2\.5-32b-instruct' is not served by this Space"):
            client.predict(prompt="hi", target="qwen2.5-32b-instruct", api_name="/generate")
        text, pieces, stats = client.predict(prompt="Say hello.", max_new_tokens=4, api_name="/generate")
        assert text and pieces and stats["tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
