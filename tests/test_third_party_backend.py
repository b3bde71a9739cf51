"""The app as a front end for a server that is not ours (`python -m app --backend URL`): llama-cpp-python's own
OpenAI-compatible server (`python -m llama_cpp.server`, its `server` extra, which .ci/run installs) serving the
registry's SmolLM2 GGUF. The UI is launched for real and driven by gradio_client; Stop through the chat's own
handlers. That server reports none of the speculative numbers and answers any model name with its one model, so what
the app says about both is part of what is tested."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from usd import store

pytestmark = pytest.mark.real_models
SMOL = "smollm2-135m-instruct"
N_CTX = 512
"""The server's context, small so that a prompt can overflow it cheaply."""
PROMPT = "Write a Python function that returns the square of a number."
COUNTING = "Count from 1 to 300, one number per line."
REQUIRE_ENV = "USD_CHAT_REQUIRE_LLAMA_SERVER"
"""Set (by .ci/run): a missing llama_cpp.server fails the tests instead of skipping them."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(real_paths, catalog, tmp_path_factory):
    """llama_cpp.server on 127.0.0.1 with the registry's SmolLM2 GGUF (from the store), as a subprocess."""
    try:
        import llama_cpp.server.app  # noqa: F401  (the `server` extra: fastapi, sse-starlette, starlette-context, ...)
    except ImportError as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"llama_cpp.server is not installed ({e}); .ci/run installs llama-cpp-python[server]")
        pytest.skip(f"llama_cpp.server is not installed ({e}): pip install 'llama-cpp-python[server]==0.3.36'")
    from conftest import USER_CACHE

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(store.CACHE_ENV, str(USER_CACHE))
        gguf = store.gguf_file(catalog.get(SMOL), log=lambda m: None)
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", SMOL]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(N_CTX), "--verbose", "False"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.time() < deadline, "llama_cpp.server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=5).is_success:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def app(server):
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    from app.__main__ import create_front_end, launch

    page, pairs = create_front_end(server, log=lambda *_: None)
    demo = page.demo
    assert pairs.loaded is not None and pairs.loaded.target == SMOL
    port = free_port()
    launch(page, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
    yield pairs, f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def ui(app):
    from gradio_client import Client

    return Client(app[1], verbose=False)


def servers_own_answer(url: str, prompt: str, n: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    return (
        client.chat.completions.create(model=SMOL, messages=messages, max_tokens=n, temperature=0)
        .choices[0]
        .message.content
    )


def test_a_chat_streams_the_servers_own_answer_and_the_stats_name_what_it_did_not_report(server, ui):
    # long enough to end at max_tokens. The first update goes out at once (app/views.py, in_background), so a
    # streamed answer shows a strict prefix before its end however fast this machine's server decodes.
    job = ui.submit(prompt=COUNTING, max_new_tokens=44, api_name="/generate")
    updates = list(job)
    text, pieces, stats = job.result()
    assert len(updates) >= 2 and len(updates[0][0]) < len(text), "the answer must stream"
    assert all(u[0] == text[: len(u[0])] for u in updates), "every update is a prefix of the answer"
    assert text == servers_own_answer(server, COUNTING, 44)  # greedy: exactly what the server generates alone
    assert "".join(p["text"] for p in pieces) == text and {p["kind"] for p in pieces} == {"target"}
    assert stats["stop_reason"] == "max_tokens" and stats["algorithm"] == "server"
    assert {"acceptance_rate", "k", "c", "v", "theoretical_speedup", "tokens"} <= set(stats["unreported"])


def test_the_panel_says_which_numbers_the_server_did_not_report(app):
    from app import remote
    from app.handlers import Handlers

    h = Handlers(app[0], stream=remote.stream)
    *_, (_, live) = h.chat_send(_request("panel"), "Say hello.", [], "auto", "auto", 0, 1, 0, None, 8)
    panel = live["stats"]
    said = panel.split("Not reported by this server: ", 1)[1]
    for name in ("acceptance α", "draft length k", "drafter cost c", "verify cost v", "theoretical speedup"):
        assert name in said
    assert "the token count" in said  # llama_cpp.server sends no usage in its stream: counted from its chunks
    assert '<td data-stat="drafter cost c">not reported</td>' in panel


def _request(session: str):
    return SimpleNamespace(session_hash=session)  # what the chat handlers read of Gradio's request


def test_stop_cancels_the_servers_answer(app, server):
    from app import remote
    from app.handlers import Handlers
    from app.views import STOPPED

    h = Handlers(app[0], stream=remote.stream)
    request = _request("stop")
    chat = h.chat_send(request, "Count from 1 to 300, one number per line.", [], "auto", "auto", 0, 1, 0, None, 600)
    next(chat)
    stopped_at = time.perf_counter()
    threading.Timer(0.2, h.chat_stop, [request]).start()
    *_, (history, live) = chat
    panel = live["stats"]
    assert time.perf_counter() - stopped_at < 10, "Stop must end the answer, not let the server run to 600 tokens"
    answer = history[-1]["content"]
    assert answer.endswith(STOPPED) and "stopped: cancelled" in panel
    assert len(answer) < len(servers_own_answer(server, COUNTING, 600))
    *_, (history, *_) = h.chat_send(_request("after"), "Say hello.", [], "auto", "auto", 0, 1, 0, None, 8)
    assert history[-1]["content"] == servers_own_answer(server, "Say hello.", 8)  # the server serves on


def test_a_model_the_server_does_not_serve_is_refused_by_name(ui):
    from gradio_client.exceptions import AppError

    # llama_cpp.server itself would answer any name with its one model: the app asks its model list first
    with pytest.raises(AppError, match=f"does not serve 'no-such-model'; it serves {SMOL}"):
        ui.predict(prompt=PROMPT, target="no-such-model", max_new_tokens=4, api_name="/generate")


def test_a_prompt_over_the_servers_context_is_its_own_message(ui):
    from gradio_client.exceptions import AppError

    # llama_cpp.server refuses it only once its stream has begun (status 200, an empty stream): the app asks again
    # unstreamed for the refusal, so the user reads the server's reason, not an empty answer
    with pytest.raises(AppError, match=f"the backend refused: This model's maximum context length is {N_CTX} tokens"):
        ui.predict(prompt="word " * (N_CTX + 100), max_new_tokens=4, api_name="/generate")
