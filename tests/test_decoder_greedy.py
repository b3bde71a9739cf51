"""Greedy speculative output is token-identical to plain greedy decoding on the real pair, in float32 on CPU:
Qwen2.5-Coder-0.5B-Instruct target with the SmolLM2-135M-Instruct drafter (and Gemma-3-270m as a third family),
every algorithm, twelve prompts (code, chat, CJK, emoji, long whitespace, a prompt over 1,000 tokens, ...), raw and
through chat templates; and equal to transformers' own cross-tokenizer assisted generation."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_pairs import how

from usd import api
from usd.decoder import stream
from usd.events import Finished, Round
from usd.pair import Pair

pytestmark = pytest.mark.real_models

FUNC = 'def add_{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
LONG = "".join(FUNC.format(i=i) for i in range(60)) + "def add_60(x):"
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "日本の首都は",
    "Emoji party: 🎉🎉",
    "x =     [1,    2,\n\n\n    3]",
    "Écrivez une phrase en français : ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Столица России —",
    '{"name": "Ada", "languages": ["',
    "| a | b |\n|---|---|\n| 1 | 2 |\n",
    "1 + 1 = 2\n2 + 2 = 4\n3 + 3 =",
    LONG,
]
MAX_NEW = 20
ALGORITHMS = [("tli", 4), ("slem", 4), ("auto", "auto")]
MORE = [("none", 4), ("tli", "auto"), ("slem", "auto"), ("tli", 1), ("slem", 8), ("ngram", 4), ("suffix", 4)]
"""Also run on every sixth prompt: CI time is spent where bugs would differ."""


def load_pair(catalog, target, drafter) -> Pair:
    from usd.loading import load_model

    t = load_model(catalog.get(target), device="cpu", precision="fp32", log=lambda m: None)
    d = load_model(catalog.get(drafter), device="cpu", precision="fp32", log=lambda m: None)
    return Pair(t.model, t.tokenizer, d.model, d.tokenizer, t.name, d.name, context_length=32768)


@pytest.fixture(scope="module")
def pair(catalog, real_paths):
    return load_pair(catalog, "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma_pair(catalog, real_paths, pair):
    from usd.loading import load_model

    d = load_model(catalog.get("gemma-3-270m"), device="cpu", precision="fp32", log=lambda m: None)
    return Pair(pair.target, pair.target_tokenizer, d.model, d.tokenizer, "qwen", "gemma", 32768)


@torch.no_grad()
def plain_greedy(model, ids: list[int], n: int = MAX_NEW) -> list[int]:
    return model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n, do_sample=False
    )[0, len(ids) :].tolist()


def check_same(done: Finished, ref: list[int], eos: set[int], what: str) -> None:
    out = list(done.target_ids)
    if done.stats.stop_reason == "eos":
        assert out == ref[: len(out)] and ref[len(out)] in eos, f"{what}: differs from plain greedy"
    else:
        assert done.stats.stop_reason == "max_tokens" and out == ref[:MAX_NEW], f"{what}: differs from plain greedy"


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_every_algorithm_equals_plain_greedy(pair, prompt):
    ids = pair.target_tokenizer.encode(prompt)
    dids = pair.drafter_tokenizer.encode(prompt)
    if prompt is LONG:
        assert len(ids) > 1000
    ref = plain_greedy(pair.target, ids)
    for algorithm, k in ALGORITHMS + (MORE if PROMPTS.index(prompt) % 6 == 0 else []):
        events = list(stream(pair, ids, dids, how(algorithm=algorithm, k=k, max_new_tokens=MAX_NEW)))
        done = events[-1]
        assert isinstance(done, Finished) and all(isinstance(e, Round) for e in events[:-1])
        check_same(done, ref, pair.eos_ids(), f"{algorithm} k={k} on {prompt[:30]!r}")
        # the rounds' emitted pieces are exactly the answer, in order
        emitted = [p.target_id for e in events[:-1] for p in e.emitted]
        assert emitted == list(done.target_ids)
        shown = "".join(p.text for e in events[:-1] for p in e.emitted)
        # pieces hold back a multi-byte character split by max_new_tokens; the final text shows it as U+FFFD
        assert done.text == shown or (done.text.startswith(shown) and done.text[len(shown) :] == "\ufffd")
        rounds = events[:-1]
        # a round drafts at most k: tli's candidates are drafter steps; slem's drafter also takes at most k steps, but
        # the target re-tokenizes their text and may count more tokens than the drafter wrote; a plain step drafts none
        assert rounds[0].k == 0 and all(r.draft_steps <= r.k for r in rounds)
        assert all(r.drafted <= r.k for r in rounds if r.algorithm != "slem")
        assert all(r.drafted == r.draft_steps == 0 for r in rounds if r.algorithm == "none")
        if algorithm in ("tli", "slem") and k == 4:
            assert done.stats.drafted > 0 and any(r.k == 4 for r in rounds)
            assert done.stats.c is not None and done.stats.v is not None
            assert all(r.algorithm in ("none", algorithm) for r in rounds)


def test_long_prompt_is_fast_to_speculate_on(pair):
    """After a 1,700-token prompt the drafter, fed through its own cache, still guesses well: rounds emit several
    tokens each."""
    ids, dids = pair.target_tokenizer.encode(LONG), pair.drafter_tokenizer.encode(LONG)
    *_, done = stream(pair, ids, dids, how(algorithm="slem", k=4, max_new_tokens=MAX_NEW))
    assert done.stats.acceptance_rate > 0.25 and done.stats.tokens_per_round > 1.5


@pytest.mark.parametrize("rendering", ["own", "stripped"])
def test_chat_answers_equal_plain_greedy_with_either_drafter_rendering(pair, rendering):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ]
    ref = api.generate(pair, messages=messages, algorithm="none", max_new_tokens=MAX_NEW)
    done = api.generate(pair, messages=messages, algorithm="tli", max_new_tokens=MAX_NEW, drafter_rendering=rendering)
    assert done.target_ids == ref.target_ids and done.stats.drafted > 0
    plain = plain_greedy(pair.target, api.chat.render_ids(pair.target_tokenizer, messages))
    check_same(ref, plain, pair.eos_ids(), "chat")


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[6], LONG], ids=range(5))
def test_gemma_drafter_equals_plain_greedy(gemma_pair, prompt):
    """A third family: SentencePiece with byte fallback drafting for a byte-level BPE target. LONG is past Gemma 3's
    512-token sliding window, where rolling back a rejected draft needs the cache's recorded past."""
    ids = gemma_pair.target_tokenizer.encode(prompt)
    dids = gemma_pair.drafter_tokenizer.encode(prompt)
    ref = plain_greedy(gemma_pair.target, ids)
    for algorithm in ("slem",) if prompt is LONG else ("tli", "slem", "auto"):  # LONG: CI time, one is enough
        *_, done = stream(gemma_pair, ids, dids, how(algorithm=algorithm, k=4, max_new_tokens=MAX_NEW))
        check_same(done, ref, gemma_pair.eos_ids(), f"gemma {algorithm} on {prompt!r}")
        if algorithm != "auto":
            assert done.stats.drafted > 0


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[1], PROMPTS[6]], ids=range(3))
def test_equals_transformers_cross_tokenizer_generate(pair, prompt):
    ids = pair.target_tokenizer.encode(prompt)
    # transformers may rewire the drafter it is given, so it gets its own copy; ours must stay untouched
    with torch.no_grad():
        theirs = pair.target.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            assistant_model=copy.deepcopy(pair.drafter),
            tokenizer=pair.target_tokenizer,
            assistant_tokenizer=pair.drafter_tokenizer,
        )[0, len(ids) :].tolist()
    for algorithm in ("tli", "slem"):
        *_, done = stream(
            pair, ids, pair.drafter_tokenizer.encode(prompt), how(algorithm=algorithm, k=4, max_new_tokens=MAX_NEW)
        )
        check_same(done, theirs, pair.eos_ids(), f"{algorithm} vs transformers")


def test_speculation_accepts_drafted_tokens_on_code(pair):
    ids = pair.target_tokenizer.encode(PROMPTS[0])
    *_, done = stream(
        pair, ids, pair.drafter_tokenizer.encode(PROMPTS[0]), how(algorithm="slem", k=4, max_new_tokens=32)
    )
    assert done.stats.acceptance_rate > 0.2 and done.stats.tokens_per_round > 1.2


@pytest.mark.parametrize("algorithm", ["none", "tli", "slem"])
def test_stop_string_ends_the_answer_where_plain_text_first_contains_it(pair, algorithm):
    ids = pair.target_tokenizer.encode(PROMPTS[0])
    dids = pair.drafter_tokenizer.encode(PROMPTS[0])
    *_, plain = stream(pair, ids, dids, how(algorithm="none", max_new_tokens=MAX_NEW))
    stop = "return"
    assert stop in plain.text
    *_, done = stream(pair, ids, dids, how(algorithm=algorithm, k=4, max_new_tokens=MAX_NEW, stop_strings=(stop,)))
    assert done.stats.stop_reason == "stop_string"
    assert stop in done.text and stop not in done.text[:-1]  # the last token completed it, not an earlier one
    assert list(done.target_ids) == list(plain.target_ids[: len(done.target_ids)])


@pytest.fixture(scope="module")
def other_backend_pair(pair):
    """The pair with its fp32 Linear layers on the other backend than the loader chose here
    (usd/runners/transformers/cpu_kernels.py): whichever this machine picks, both ways of running the model are held to
    the same bar."""
    from usd.runners.transformers.cpu_kernels import backend_of, use_default, use_onednn

    models = [copy.deepcopy(pair.target), copy.deepcopy(pair.drafter)]
    for m in models:
        (use_default if backend_of(m) == "onednn" else use_onednn)(m)
    return Pair(models[0], pair.target_tokenizer, models[1], pair.drafter_tokenizer, "qwen", "smol", 32768)


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[3]], ids=range(2))  # code, emoji: CI time
def test_the_other_linear_backend_equals_plain_greedy_too(other_backend_pair, prompt):
    p = other_backend_pair
    ids, dids = p.target_tokenizer.encode(prompt), p.drafter_tokenizer.encode(prompt)
    ref = plain_greedy(p.target, ids)
    for algorithm, k in [("tli", 4), ("slem", 4), ("auto", "auto")]:
        *_, done = stream(p, ids, dids, how(algorithm=algorithm, k=k, max_new_tokens=MAX_NEW))
        check_same(done, ref, p.eos_ids(), f"{algorithm} on the other backend, {prompt[:30]!r}")
