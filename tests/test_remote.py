"""The --backend stream without a server: chunks as the openai client hands them over, turned into the engine's events;
what a third-party server leaves out is named, and a stream a server ends without a finish reason is an error."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from app import remote, render
from usd import chat
from usd.algorithms import Algorithm
from usd.events import Finished
from usd.settings import GenerationSettings


def chunk(text: str | None, reason: str | None = None, **extra) -> ChatCompletionChunk:
    delta = {} if text is None else {"content": text}
    choice = {"index": 0, "delta": delta, "finish_reason": reason}
    return ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice], **extra}
    )


class FakeStream(list):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeClient:
    """`client.chat.completions.create` of the openai client: a stream of the given chunks, or unstreamed, `refusal`."""

    base_url = "http://127.0.0.1:1/v1"

    def __init__(self, chunks, refusal: Exception | None = None):
        self.chunks, self.refusal, self.asked = chunks, refusal, []
        self.chat = self.completions = self  # client.chat.completions.create

    def with_options(self, **_):
        return self

    def create(self, **args):
        self.asked.append(args)
        if not args["stream"]:
            if self.refusal is not None:
                raise self.refusal
            return None
        return FakeStream(self.chunks)


def run(client) -> list:
    model = remote.RemoteModel(client, "m", None, usd=False)
    return list(remote.stream(model, messages=chat.user_turn("hi"), settings=GenerationSettings(max_new_tokens=4)))


def test_a_plain_servers_answer_names_the_numbers_it_did_not_report():
    events = run(FakeClient([chunk("Hel"), chunk("lo"), chunk(None, "length")]))
    done = events[-1]
    assert isinstance(done, Finished) and done.text == "Hello" and done.stats.stop_reason == "max_tokens"
    live = render.Live(Algorithm.AUTO)
    for event in events:
        live.add(event)
    n = live.numbers()
    assert {"acceptance_rate", "k", "c", "v", "theoretical_speedup", "tokens"} <= set(n["unreported"])
    said = render.unreported_text(n)
    assert said.startswith("Not reported by this server: acceptance α, tokens per target forward τ, draft length k")
    assert '<td data-stat="verify cost v">not reported</td>' in render.stats_html(n, Algorithm.AUTO)


def test_what_vllm_reports_is_shown_and_only_the_rest_is_named():
    metrics = {"speculative_decoding": {"num_draft_tokens": 6, "num_accepted_draft_tokens": 3, "num_spec_steps": 2}}
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    events = run(FakeClient([chunk("Hello"), chunk(None, "stop", metrics=metrics, usage=usage)]))
    n = render.Live(Algorithm.AUTO)
    for event in events:
        n.add(event)
    numbers = n.numbers()
    assert numbers["acceptance_rate"] == 0.5 and numbers["tokens"] == 5
    assert "acceptance_rate" not in numbers["unreported"] and "tokens" not in numbers["unreported"]
    assert {"c", "v"} <= set(numbers["unreported"])
    assert render.unreported_text(render.Live(Algorithm.AUTO).numbers()) is None  # nothing yet: nothing to say


def test_an_empty_stream_becomes_the_servers_refusal_asked_again_unstreamed():
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    body = {"message": "This model's maximum context length is 512 tokens.", "code": "context_length_exceeded"}
    refusal = openai.BadRequestError("400", response=httpx.Response(400, request=request), body=body)
    client = FakeClient([], refusal)
    with pytest.raises(ValueError, match="the backend refused: This model's maximum context length is 512 tokens"):
        run(client)
    assert [a["stream"] for a in client.asked] == [True, False] and client.asked[1]["max_tokens"] == 1
    with pytest.raises(ValueError, match="stream ended empty, without a finish reason"):
        run(FakeClient([]))  # asked again, it answers: the server's log is all there is


def test_a_stream_broken_off_mid_answer_is_an_error_not_a_short_answer():
    with pytest.raises(ValueError, match="stream broke off after 2 pieces, without a finish reason"):
        run(FakeClient([chunk("Hel"), chunk("lo")]))
