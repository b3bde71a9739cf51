"""The OpenAI-compatible server on the default pair, driven by the official `openai` client, all on 127.0.0.1: the
routes in-process (`usd.serve`, the pair loaded once), inside the app next to the UI, and `usd serve` as a
subprocess behind the app's --backend."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tiny_serving import free_port, serving

import usd
from usd import chat

pytestmark = pytest.mark.real_models
ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
ASK = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
N = 8


@pytest.fixture(scope="module")
def pair(real_paths):
    return usd.load_pair(log=lambda *_: None)


@pytest.fixture(scope="module")
def server(pair):
    from usd.serve import FixedPair, Slots, create_app

    service = FixedPair(pair, slots=Slots(concurrency=2, max_queue=16), api_key=KEY)
    with serving(create_app(service)) as root:
        yield f"{root}/v1", service


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0], api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def expected(pair):
    """The target's own greedy answers (plain decoding through the API), computed once."""
    cache = {}

    def answer(n: int = N, **inputs):
        key = (n, repr(sorted(inputs.items())))
        if key not in cache:
            cache[key] = usd.generate(pair, **inputs, algorithm="none", max_new_tokens=n)
        return cache[key]

    return answer


def check_speculative(spec: dict, tokens: int) -> None:
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert spec["tokens_per_round"] >= 1 and spec["rounds"] >= 1 and spec["tokens"] == tokens
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] <= spec["rounds"]
    if spec["num_draft_tokens"]:
        assert spec["draft_acceptance_rate"] == spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"]
        assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]


def test_models_lists_the_loaded_target(client, pair):
    (model,) = client.models.list().data
    assert model.id == pair.target_name and model.owned_by == "usd-chat"
    assert model.model_extra["drafter"] == pair.drafter_name


def test_chat_greedy_is_the_targets_answer_with_usage_and_stats(client, pair, expected):
    spec = {"algorithm": "slem", "draft_tokens": 3}
    r = client.chat.completions.create(
        model=pair.target_name, messages=ASK, max_tokens=N, temperature=0, extra_body={"speculative": spec}
    )
    want = expected(messages=ASK)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == pair.target_name
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == len(want.target_ids) == N
    assert r.usage.prompt_tokens == len(chat.prompt_ids(pair, messages=ASK)[0])
    assert r.usage.total_tokens == r.usage.prompt_tokens + N
    spec = r.model_extra["speculative"]
    assert spec["algorithm"] == "slem" and spec["num_draft_tokens"] > 0
    check_speculative(spec, N)


def test_chat_stream_sends_pieces_stats_usage_and_done(client, server, pair, expected):
    chunks = list(
        client.chat.completions.create(
            model=pair.target_name,
            messages=ASK,
            max_completion_tokens=N,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": {"algorithm": "tli", "pieces": True}},
        )
    )
    want = expected(messages=ASK)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    pieces = [p for c in chunks for p in (c.model_extra.get("speculative") or {}).get("pieces", [])]
    assert {p["kind"] for p in pieces} <= {"accepted", "rejected", "resampled", "bonus", "target"}
    assert "".join(p["text"] for p in pieces if p["kind"] != "rejected") == want.text
    assert all(isinstance(p["round"], int) for p in pieces)
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length"
    check_speculative(final[0].model_extra["speculative"], N)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    # on the wire: SSE data lines, ending with [DONE]
    body = {"model": pair.target_name, "messages": ASK, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{server[0]}/chat/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_completions_plain_and_streamed(client, pair, expected):
    prompt = "def fibonacci(n):"
    want = expected(prompt=prompt)
    r = client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == len(pair.target_tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=N, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    check_speculative(chunks[-1].model_extra["speculative"], N)


def test_stop_ends_the_text_before_it_with_finish_reason_stop(client, pair, expected):
    prompt = "def fibonacci(n):"
    full = expected(12, prompt=prompt).text
    stop = full.strip().split()[1]  # a word from the middle of the answer
    want = full[: full.index(stop)]
    r = client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=12, stop=[stop, "@@@"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.model_extra["speculative"]["stop_reason"] == "stop_string"
    chunks = list(
        client.completions.create(model=pair.target_name, prompt=prompt, max_tokens=12, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer(client, pair):
    def sample(seed):
        return (
            client.chat.completions.create(
                model=pair.target_name, messages=ASK, max_tokens=6, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sample(11) == sample(11)


def test_errors_reach_the_client_as_openais_exceptions_with_the_engines_message(client, server, pair):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature must be a number from 0") as e:
        client.chat.completions.create(model=pair.target_name, messages=ASK, temperature=9)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.chat.completions.create(model=pair.target_name, messages=ASK, n=2)
    with pytest.raises(openai.BadRequestError, match="log probabilities"):
        client.completions.create(model=pair.target_name, prompt="x", logprobs=2)
    with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
        client.completions.create(model=pair.target_name, prompt="  ")
    with pytest.raises(openai.BadRequestError, match=f"context of {pair.context_length:,} tokens") as e:
        client.completions.create(model=pair.target_name, prompt="word " * 33_000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="lower max new tokens to at most") as e:
        client.chat.completions.create(
            model=pair.target_name,
            messages=[{"role": "user", "content": "w " * (pair.context_length - 3000)}],  # fits, but not with 4096 more
            max_tokens=4096,
        )
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' is not served here") as e:
        client.chat.completions.create(model="gpt-4o", messages=ASK)
    assert e.value.code == "model_not_found"
    wrong = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        wrong.models.list()
    r = httpx.get(f"{server[0]}/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("missing API key")


def test_a_full_queue_is_a_429(client, server, pair):
    import openai

    service = server[1]
    service.slots.configure(concurrency=1, max_queue=0)
    try:
        stream = client.chat.completions.create(model=pair.target_name, messages=ASK, max_tokens=200, stream=True)
        next(iter(stream))  # running: it holds the only slot
        with pytest.raises(openai.RateLimitError, match="the server is busy") as e:
            client.chat.completions.create(model=pair.target_name, messages=ASK, max_tokens=2)
        assert e.value.code == "queue_full"
        stream.close()
    finally:
        wait_idle(service)
        service.slots.configure(concurrency=2, max_queue=16)


def wait_idle(service, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while service.slots.running or service.slots.waiting:
        assert time.time() < deadline, "a generation kept its slot"
        time.sleep(0.05)


def test_a_client_that_disconnects_frees_its_slot_and_the_next_is_served(client, server, pair, expected):
    url, service = server
    service.slots.configure(concurrency=1, max_queue=16)
    try:
        body = {"model": pair.target_name, "messages": ASK, "max_tokens": 1000, "stream": True}
        with httpx.stream(
            "POST", f"{url}/chat/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:  # the role chunk and two rounds: then the client goes away
                    break
            assert service.slots.running == 1
        wait_idle(service, 60)  # cancelled within a round, not after 1000 tokens
        r = client.chat.completions.create(model=pair.target_name, messages=ASK, max_tokens=N)
        assert r.choices[0].message.content == expected(messages=ASK).text
    finally:
        service.slots.configure(concurrency=2, max_queue=16)


def test_eight_concurrent_streaming_clients_each_get_their_own_answer(client, pair, expected):
    prompts = [[{"role": "user", "content": f"Write the number {n} in words, then stop."}] for n in range(8)]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        chunks = client.chat.completions.create(model=pair.target_name, messages=prompts[i], max_tokens=5, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(8))
    for i, text in results.items():
        assert text == expected(5, messages=prompts[i]).text, f"client {i} got another answer"


def test_the_app_serves_the_ui_and_v1_side_by_side(pair, expected, monkeypatch):
    from gradio_client import Client
    from openai import OpenAI

    from app.__main__ import create, launch

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.setattr(usd.api, "load_pair", lambda *a, **k: pair)  # the module's pair: no second load
    page, pairs = create(log=lambda *_: None, api_key=KEY)
    port = free_port()
    launch(page, "127.0.0.1", port, concurrency=1, max_queue=16, prevent_thread_lock=True, quiet=True)
    try:
        ui = Client(f"http://127.0.0.1:{port}/", verbose=False)
        v1 = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
        prompt = ASK[0]["content"]
        out = {}
        threads = [
            threading.Thread(
                target=lambda: out.setdefault("ui", ui.predict(prompt=prompt, max_new_tokens=N, api_name="/generate"))
            ),
            threading.Thread(
                target=lambda: out.setdefault(
                    "v1", v1.chat.completions.create(model=pairs.loaded.target, messages=ASK, max_tokens=N)
                )
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        want = expected(messages=ASK).text
        assert out["ui"][0] == want and out["v1"].choices[0].message.content == want
        assert v1.models.list().data[0].id == pair.target_name
    finally:
        page.demo.close()


def test_the_app_as_a_front_end_for_usd_serve_shows_pieces_and_stats(tmp_path, real_paths, expected):
    from gradio_client import Client

    from app.__main__ import create_front_end, launch

    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    env = {**os.environ, "USD_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "usd", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    page = None
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "usd serve did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).is_success:
                    break
            time.sleep(1)
        page, _ = create_front_end(url, api_key=KEY, log=lambda *_: None)
        app_port = free_port()
        launch(page, "127.0.0.1", app_port, prevent_thread_lock=True, quiet=True)
        ui = Client(f"http://127.0.0.1:{app_port}/", verbose=False)
        job = ui.submit(prompt=ASK[0]["content"], algorithm="slem", max_new_tokens=N, api_name="/generate")
        updates = list(job)
        text, pieces, stats = job.result()
        assert text == expected(messages=ASK).text
        assert len(updates) >= 2, "the answer streams"
        assert any(p["kind"] == "accepted" for p in pieces) or any(p["kind"] == "rejected" for p in pieces)
        assert "".join(p["text"] for p in pieces if p["kind"] != "rejected") == text
        assert stats["tokens"] == N and stats["stop_reason"] == "max_tokens" and stats["rounds"] >= 1
        assert stats["acceptance_rate"] is not None and stats["tokens_per_round"] >= 1
    finally:
        if page is not None:
            page.demo.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
