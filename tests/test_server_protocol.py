"""The server's wire format and its slots, without models: requests read into GenerationSettings, refusals by name,
stop strings cut as OpenAI cuts them, and the shared concurrency limit."""

from __future__ import annotations

import threading
import time

import pytest

from usd.events import Finished, Stats
from usd.serve import protocol as p
from usd.serve.slots import QueueFull, Slots


def chat(**fields):
    return p.parse(p.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_settings_come_from_generation_settings_with_openai_names():
    s = p.settings_of(
        chat(
            max_completion_tokens=12,
            temperature="0.5",
            top_p=0.9,
            seed=3,
            stop="\n",
            speculative={"algorithm": "slem", "draft_tokens": 4},
            top_k=5,
        )
    )
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed, s.stop_strings) == (12, 0.5, 0.9, 3, ("\n",))
    assert (s.algorithm, s.draft_tokens, s.top_k) == ("slem", 4, 5)
    assert p.settings_of(chat()).temperature == 0.0  # the engine's defaults (greedy), not OpenAI's


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": 9}, "temperature", "temperature must be a number from 0 (greedy) to 5, got 9"),
        ({"max_tokens": 0}, "max_tokens", "max new tokens must be a whole number from 1 to 4,096"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens", "max new tokens must be a whole number"),
        ({"speculative": {"algorithm": "fastest"}}, "speculative.algorithm", "unknown algorithm 'fastest'"),
        ({"speculative": {"draft_tokens": 99}}, "speculative.draft_tokens", "draft tokens must be auto or"),
        ({"stop": 5}, "stop", "stop strings must be a list of texts"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "differ"),
    ],
)
def test_bad_settings_are_400s_with_the_engines_message_and_the_field(fields, param, message):
    with pytest.raises(p.APIError) as err:
        p.settings_of(chat(**fields))
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2}, "one choice per request"),
        ({"logprobs": True}, "log probabilities"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool and function calling"),
        ({"presence_penalty": 0.5}, "penalties"),
        ({"response_format": {"type": "json_object"}}, "structured output"),
        ({"frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"speculative": {"colour": "green"}}, "unknown field 'speculative.colour'"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_by_name(fields, message):
    with pytest.raises(p.APIError, match=message) as err:
        chat(**fields)
    assert err.value.status == 400


def test_no_op_values_of_unsupported_fields_pass():
    chat(
        n=1,
        logprobs=False,
        presence_penalty=0,
        tools=[],
        tool_choice="none",
        user="u",
        metadata={"a": "b"},
        response_format={"type": "text"},
    )


def test_messages_and_prompts():
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert p.chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    for messages, message in [
        ([{"role": "user", "content": "hi", "name": "x"}], "'name' not supported"),
        ([{"role": "tool", "content": "x"}], "tool and function calling"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text"),
        ([{"role": "assistant", "content": "x"}], "the last message must be the user's"),
    ]:
        with pytest.raises(p.APIError, match=message):
            p.chat_messages(chat(messages=messages))
    completion = p.parse(p.CompletionRequest, {"model": "m", "prompt": ["once"]})
    assert p.completion_prompt(completion) == "once"
    with pytest.raises(p.APIError, match="token ids"):
        p.completion_prompt(p.parse(p.CompletionRequest, {"model": "m", "prompt": [1, 2]}))
    with pytest.raises(p.APIError, match="model is required"):
        p.parse(p.CompletionRequest, {"prompt": "x"})


def test_stop_strings_end_the_text_before_them_even_across_chunks():
    assert p.trimmed("Hello, world. Bye", ("world",)) == "Hello, "
    trim, out = p.StopTrim(("END", "\n\n")), ""
    for piece in ["a E", "N", "x b\n", "c\n", "\nmore"]:
        out += trim.feed(piece)
    assert out + trim.end() == "a ENx b\nc"
    trim = p.StopTrim(("END",))
    assert trim.feed("abc E") == "abc " and trim.end() == "E"  # a held-back start that never completed comes at end


def test_slots_limit_running_and_waiting():
    slots = Slots(concurrency=1, max_queue=1)
    order = []
    with slots.hold() as ok:
        assert ok and slots.running == 1
        waiter = slots.join()
        with pytest.raises(QueueFull, match="busy"):
            slots.join()
        t = threading.Thread(target=lambda: (waiter.wait(), order.append("second"), waiter.leave()))
        t.start()
        time.sleep(0.2)
        assert order == []
    t.join(5)
    assert order == ["second"] and slots.running == 0 and slots.waiting == 0
    cancel = threading.Event()
    with slots.hold():
        cancel.set()
        with slots.hold(cancel) as ok:
            assert ok is False  # stopped while waiting: holds nothing
    assert slots.running == 0 and slots.waiting == 0


def test_in_space_mode_a_request_may_name_only_what_the_space_serves(monkeypatch):
    from app.pairs import Pairs
    from app.v1 import AppService
    from usd.catalog import load_catalog

    monkeypatch.setenv("USD_CHAT_SPACE_MODELS", "")
    catalog = load_catalog()
    service = AppService(Pairs(catalog, space_mode=True))
    assert service.resolve(catalog.default.target) == catalog.default.target
    with pytest.raises(p.APIError, match=r"'qwen2\.5-32b-instruct' is not served here; this Space serves only") as e:
        service.resolve("qwen2.5-32b-instruct")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    assert "qwen2.5-32b-instruct" not in [m["id"] for m in service.models()]


def held_back_by_trying_every_prefix(text: str, stops: tuple[str, ...]) -> int:
    """The old, quadratic rule for how much of a streamed text to hold back: the longest end of it that begins a stop
    string, found by trying every prefix of every stop string."""
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


def test_stop_trim_holds_back_exactly_what_could_begin_a_stop_string():
    """The linear matcher against the rule it replaced, on random texts over a small alphabet (where stop strings
    overlap themselves and each other often), chunk by chunk."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        trim, out, seen = p.StopTrim(stops), "", ""
        while seen != text and not trim.done:
            chunk = text[len(seen) : len(seen) + rng.randint(1, 5)]
            seen += chunk
            out += trim.feed(chunk)
            if not trim.done:
                assert len(trim.held) == held_back_by_trying_every_prefix(seen, stops), (stops, seen)
        assert out + trim.end() == p.trimmed(text, stops), (stops, text)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert p.trimmed(text, stops) == text[:cut]


def test_a_text_that_is_not_unicode_is_a_400_that_says_where():
    with pytest.raises(p.APIError, match=r"message 0's content is not valid text: it holds a lone surrogate") as e:
        p.chat_messages(chat(messages=[{"role": "user", "content": "a\ud800b"}]))
    assert e.value.status == 400 and "'\\ud800') at character 1" in e.value.message
    with pytest.raises(p.APIError, match=r"the prompt is not valid text: it holds a lone surrogate"):
        p.completion_prompt(p.parse(p.CompletionRequest, {"model": "m", "prompt": "x\udfff"}))
    with pytest.raises(p.APIError, match="stop string 0 is not valid text") as e:
        p.settings_of(chat(stop=["\ud800"]))
    assert e.value.param == "stop"


def test_errors_beyond_the_routes_have_openais_shape():
    from usd.serve.routes import unknown_route

    e = unknown_route("GET", "/v1/chat/completions")
    assert e.status == 405 and e.message == "GET /v1/chat/completions is not allowed; use POST /v1/chat/completions"
    e = unknown_route("POST", "/v1/embeddings")
    assert e.status == 404 and e.message.startswith("there is no route POST /v1/embeddings here; this server answers")
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    e = p.too_large(p.MAX_BODY_BYTES, 30_000_000)
    assert e.status == 413 and "over the server's limit of 4,194,304 bytes (this one is 30,000,000 bytes)" in e.message


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_prompt_is_refused_by_its_bytes_only_when_its_tokens_could_not_fit(tiny_tokenizers, kind):
    """api.check_size refuses before tokenizing, from lower bounds on the token count: never a prompt that fits.
    Random texts of words, punctuation, runs of spaces and characters outside the vocabularies (byte fallback)."""
    import random

    from usd import api, chat
    from usd.pair import Pair

    tokenizer = tiny_tokenizers["target" if kind == "byte-level" else "sentencepiece"]
    pair = Pair(None, tokenizer, context_length=64)
    rng = random.Random(0)
    pieces = ["def", " fibonacci", "(n)", ":", " ", "    ", "\n", "=" * 8, ", ", "日本", "🎉", "Écrivez", "42"]
    pieces.append("<|im_end|>")
    refused = 0
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        try:
            api.check_size(pair, text)
        except api.ContextLengthError as e:
            refused += 1
            assert "at least" in str(e)
            assert len(chat.target_ids(pair, text)) >= pair.context_length, text
    assert refused > 20  # the test is not vacuous
    with pytest.raises(api.ContextLengthError, match=r"the prompt is 2,000,000 bytes, at least [\d,]+ tokens"):
        api.check_size(pair, "word " * 400_000)


def test_long_prompts_are_tokenized_two_at_a_time_and_short_ones_never_wait(tiny_tokenizers, monkeypatch):
    """Ten long prompts tokenized at once took both cores and gigabytes (issue 27 point 2); they take turns now."""
    from usd import api, chat
    from usd.pair import Pair
    from usd.settings import GenerationSettings

    pair = Pair(None, tiny_tokenizers["target"], context_length=10_000_000)
    running, most, short_waited = [0], [0], []
    lock = threading.Lock()
    real = chat.target_ids

    def counting(pair, prompt=None, messages=None):
        if len(prompt) < 1000:
            return real(pair, prompt, messages)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return real(pair, prompt, messages)

    monkeypatch.setattr(chat, "target_ids", counting)
    long = ", " * 40_000  # no letters: past the cheap bounds, tokenized
    threads = [threading.Thread(target=api.count_prompt, args=(pair, GenerationSettings(), long)) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    api.count_prompt(pair, GenerationSettings(), "a short prompt")
    short_waited.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    assert most[0] == 2
    assert short_waited[0] < 0.4, "a short prompt waited behind the long ones"  # they take 0.6 s in all


def _finished(stop_reason: str) -> Finished:
    stats = Stats(
        "slem",
        rounds=2,
        drafted=3,
        accepted=2,
        tokens=4,
        wall_s=0.5,
        stop_reason=stop_reason,
        c=None,
        v=None,
        mean_k=1.5,
    )
    return Finished(text="four", target_ids=(1, 2, 3, 4), stats=stats)


def test_responses_and_chunks_are_the_openai_packages_types_on_the_wire():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    chat, text = (
        p.Shape(chat=True, model="m", id="chatcmpl-1", created=7),
        p.Shape(chat=False, model="m", id="c", created=7),
    )
    head = {"id": "chatcmpl-1", "created": 7, "model": "m"}
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    response = chat.response("four", _finished("max_tokens"), 3, {"algorithm": "slem"})
    assert response == {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "four"},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": usage,
        "speculative": {"algorithm": "slem"},
    }
    assert ChatCompletion.model_validate(response).choices[0].message.content == "four"
    assert chat.chunk(role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("fo")["choices"] == [
        {"index": 0, "delta": {"content": "fo"}, "finish_reason": None, "logprobs": None}
    ]
    last = chat.chunk(None, "stop", spec={"tokens": 4})
    assert last["choices"][0]["delta"] == {} and last["speculative"] == {"tokens": 4}
    assert ChatCompletionChunk.model_validate(chat.usage_chunk(3, 4)).usage.total_tokens == 7
    done = text.response("four", _finished("eos"), 3, {})
    assert Completion.model_validate(done).choices[0].finish_reason == "stop" and done["object"] == "text_completion"
    assert text.chunk("fo")["choices"] == [{"index": 0, "text": "fo", "finish_reason": None, "logprobs": None}]
    assert text.usage_chunk(3, 4)["choices"] == [] and text.usage_chunk(3, 4)["usage"] == usage


@pytest.mark.parametrize("shape", [p.Shape(chat=True, model="m"), p.Shape(chat=False, model="m")])
def test_a_response_the_openai_schema_refuses_fails_in_the_server_not_in_a_client(shape):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="finish_reason"):
        shape.chunk("x", reason="cancelled")  # not one of OpenAI's finish reasons
    with pytest.raises(ValidationError, match="prompt_tokens"):
        shape.usage_chunk(3.5, 4)  # a count that is not a whole number


def test_an_engine_bug_is_a_500_that_asks_for_a_report_and_bad_input_a_400():
    from usd.errors import InternalError
    from usd.serve.routes import engine_error

    bug = engine_error(InternalError("candidate 0 (id 7) has q = 0"))
    assert bug.status == 500 and bug.body()["error"]["code"] == "internal_error"
    assert bug.message == "internal error (a bug in the engine, please report it): candidate 0 (id 7) has q = 0"
    assert engine_error(ValueError("temperature must be a number")).status == 400


def test_the_engine_stats_go_over_the_wire_and_come_back_whole():
    """One codec: what usd serve writes as `speculative` is what the app reads back when it is that server's front
    end (every Stats field the engine counts)."""
    import dataclasses

    from usd.events import Stats

    stats = Stats(
        algorithm="tli",
        rounds=12,
        drafted=30,
        accepted=21,
        tokens=40,
        wall_s=1.5,
        stop_reason="max_tokens",
        c=0.3,
        v=1.8,
        mean_k=3.0,
        rounds_by_algorithm={"none": 2, "tli": 10},
        drafted_by_algorithm={"tli": 30},
        accepted_by_algorithm={"tli": 21},
        forward_s=1.2,
        drafting_stopped="the drafter's context is full",
        step_s=0.03,
    )
    counts = p.Counts()
    counts.histogram = [1, 2, 3, 4]
    back = p.stats_from_speculative(p.speculative_stats(stats, counts))
    assert dataclasses.asdict(back) == dataclasses.asdict(stats)
