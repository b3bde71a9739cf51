"""Greedy speculative output is token-identical to plain greedy decoding on the real pair, in float32 on CPU."""

from __future__ import annotations

import pytest
import torch

from usd.decoder import Pair, stream
from usd.events import Finished, Round

pytestmark = pytest.mark.real_models

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "日本の首都は",
    "Emoji party: 🎉🎉",
    "x =     [1,    2,\n\n\n    3]",
    "Écrivez une phrase en français : ",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair(catalog, real_paths):
    from usd.loading import load_model

    t = load_model(catalog.get("qwen2.5-coder-0.5b-instruct"), device="cpu", precision="fp32", log=lambda m: None)
    d = load_model(catalog.get("smollm2-135m-instruct"), device="cpu", precision="fp32", log=lambda m: None)
    return Pair(t.model, t.tokenizer, d.model, d.tokenizer)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_algorithm_equals_plain_greedy(pair, prompt):
    ids = pair.target_tokenizer.encode(prompt)
    dids = pair.drafter_tokenizer.encode(prompt)
    with torch.no_grad():
        ref = pair.target.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids) :]
    ref = ref.tolist()
    for algorithm in ("none", "tli", "slem", "auto"):
        events = list(stream(pair, ids, dids, algorithm=algorithm, k=4, max_new_tokens=MAX_NEW))
        done = events[-1]
        assert isinstance(done, Finished) and all(isinstance(e, Round) for e in events[:-1])
        out = list(done.target_ids)
        if done.stats.stop_reason == "eos":
            assert out == ref[: len(out)]
        else:
            assert done.stats.stop_reason == "max_tokens" and out == ref, f"{algorithm} differs on {prompt!r}"
        # the rounds' emitted pieces are exactly the answer, in order
        emitted = [p.target_id for e in events[:-1] for p in e.emitted]
        assert emitted == out
        shown = "".join(p.text for e in events[:-1] for p in e.emitted)
        # pieces hold back a multi-byte character split by max_new_tokens; the final text shows it as U+FFFD
        assert done.text == shown or (done.text.startswith(shown) and done.text[len(shown) :] == "\ufffd")
        rounds = events[:-1]
        assert rounds[0].k == 0 and all(r.drafted <= r.k for r in rounds)
        if algorithm != "none":
            assert done.stats.drafted > 0 and any(r.k == 4 for r in rounds)
            assert done.stats.c is not None and done.stats.v is not None


def test_speculation_accepts_drafted_tokens_on_code(pair):
    ids = pair.target_tokenizer.encode(PROMPTS[0])
    *_, done = stream(pair, ids, pair.drafter_tokenizer.encode(PROMPTS[0]), algorithm="slem", k=4, max_new_tokens=32)
    assert done.stats.acceptance_rate > 0.2 and done.stats.tokens_per_round > 1.2


@pytest.mark.parametrize("algorithm", ["none", "tli", "slem"])
def test_stop_string_ends_the_answer_where_plain_text_first_contains_it(pair, algorithm):
    ids = pair.target_tokenizer.encode(PROMPTS[0])
    dids = pair.drafter_tokenizer.encode(PROMPTS[0])
    *_, plain = stream(pair, ids, dids, algorithm="none", max_new_tokens=MAX_NEW)
    stop = "return"
    assert stop in plain.text
    *_, done = stream(pair, ids, dids, algorithm=algorithm, k=4, max_new_tokens=MAX_NEW, stop_strings=(stop,))
    assert done.stats.stop_reason == "stop_string"
    assert stop in done.text and stop not in done.text[:-1]  # the last token completed it, not an earlier one
    assert list(done.target_ids) == list(plain.target_ids[: len(done.target_ids)])
