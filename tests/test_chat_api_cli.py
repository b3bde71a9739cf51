"""Prompts and conversations (usd/chat.py), the Python API's input errors (usd/api.py), and `usd generate`.

Proven here:
- check_messages names what is wrong with a conversation (bad role, missing keys, content not text, last message
  not the user's, empty question); base models get a plain-text rendering;
- the target and a templated drafter (Qwen, SmolLM2) get their own ChatML, a template-less model (Gemma base) gets
  plain text, and the "stripped" drafter rendering is the target's text without any special token;
- the drafter rendering `auto` tries `own` twice, then `stripped` twice, then keeps the one with the better measured
  acceptance; a generation that drafted nothing does not count as a try; and the choice never changes greedy output;
- every bad API input raises ValueError with a message that says what to change, before any model is touched;
- `usd generate` on the real default pair (float32, CPU): the --json schema; speculative output equal to
  `--algorithm none`; `--samples` reproducible from `--seed`; `--messages-file` and `--chat` equal to the target's own
  greedy answer to the templated conversation; and plain (non-json) mode printing exactly the answer.
"""

from __future__ import annotations

import json

import pytest
import torch

import usd
from usd import chat
from usd.cli import main
from usd.memory import LoadCosts, PairMemory, RenderingTally
from usd.pair import Pair
from usd.settings import GenerationSettings

QWEN, SMOL, GEMMA = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"
HELLO = [{"role": "user", "content": "Hello"}]
CONVERSATION = [
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another one?"},
]

# ---------------------------------------------------------------------------------------------------------------------
# check_messages, plain_text


BAD_MESSAGES = [
    pytest.param([], "messages must be a non-empty list of {role, content} objects", id="empty"),
    pytest.param("Hello", "messages must be a non-empty list of {role, content} objects", id="not-a-list"),
    pytest.param(
        [{"role": "bot", "content": "hi"}],
        "message 0 has role 'bot'; use one of system, user, assistant",
        id="bad-role",
    ),
    pytest.param(
        [{"role": "user"}],
        "message 0 must be an object with exactly the keys 'role' and 'content', got {'role': 'user'}",
        id="no-content",
    ),
    pytest.param(
        [{"role": "user", "content": "hi", "name": "x"}],
        "message 0 must be an object with exactly the keys "
        "'role' and 'content', got {'role': 'user', 'content': 'hi', 'name': 'x'}",
        id="extra-key",
    ),
    pytest.param(
        ["hi"], "message 0 must be an object with exactly the keys 'role' and 'content', got 'hi'", id="not-an-object"
    ),
    pytest.param([{"role": "user", "content": 3}], "message 0 content must be text, got int", id="content-not-text"),
    pytest.param(
        CONVERSATION[:2],
        "the last message must be the user's (the model answers it), got 'assistant'",
        id="last-assistant",
    ),
    pytest.param(
        [{"role": "system", "content": "Be brief."}],
        "the last message must be the user's (the model answers it), got 'system'",
        id="only-system",
    ),
    pytest.param(
        [*CONVERSATION[:2], {"role": "user", "content": "  \n"}],
        "the last user message is empty; type a question or a prompt",
        id="empty-question",
    ),
]


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES)
def test_check_messages_says_what_is_wrong(messages, message):
    with pytest.raises(chat.PromptError) as e:
        chat.check_messages(messages)
    assert str(e.value) == message, "the whole message: what is wrong, where, and what was given"


def test_check_messages_returns_a_clean_copy():
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    out = chat.check_messages(messages)
    assert out == messages and all(a is not b for a, b in zip(out, messages, strict=True))


def test_plain_text_for_a_base_model():
    messages = [{"role": "system", "content": " Be brief. "}, *CONVERSATION]
    assert chat.plain_text(messages) == (
        "System: Be brief.\n\nUser: Name a prime number.\n\nAssistant: 7\n\nUser: Another one?\n\nAssistant:"
    )


# ---------------------------------------------------------------------------------------------------------------------
# renderings with the real tokenizers


@pytest.mark.real_models
@pytest.mark.parametrize("name", [QWEN, SMOL])
def test_chatml_models_get_their_own_template(real_tokenizers, name):
    tok = real_tokenizers[name]
    assert chat.has_template(tok)
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    ids = chat.render_ids(tok, messages)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nName a prime number.<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n")
    # the markers are the special tokens themselves, not their characters spelled out
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 5 and ids.count(end) == 4
    assert ids[0] == start  # no bos added in front of the template


@pytest.mark.real_models
def test_a_model_without_template_gets_plain_text(real_tokenizers):
    tok = real_tokenizers[GEMMA]
    assert not chat.has_template(tok)
    ids = chat.render_ids(tok, CONVERSATION)
    assert ids == tok.encode(chat.plain_text(CONVERSATION)) and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == chat.plain_text(CONVERSATION)


def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


@pytest.mark.real_models
def test_stripped_rendering_has_no_special_tokens(real_tokenizers):
    tq, ts, tg = real_tokenizers[QWEN], real_tokenizers[SMOL], real_tokenizers[GEMMA]
    t_ids = chat.render_ids(tq, CONVERSATION)
    ids = chat.stripped_ids(tq, t_ids, ts)
    assert not set(ids) & special_ids(ts)
    text = ts.decode(ids)
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    assert text == tq.decode(t_ids, skip_special_tokens=True)
    assert "user\nName a prime number.\nassistant\n7\nuser\nAnother one?\nassistant\n" in text
    # a SentencePiece drafter keeps only the bos its tokenizer always puts first
    g_ids = chat.stripped_ids(tq, t_ids, tg)
    assert g_ids[0] == tg.bos_token_id and not set(g_ids[1:]) & special_ids(tg)


class _Untouchable:
    """A model stand-in: anything that touches it fails the test (input errors must come before model work)."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was used ({name}) before the input was checked")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the model was run before the input was checked")


def stub_pair(target_tokenizer, drafter_tokenizer=None, context_length=None) -> Pair:
    drafter = _Untouchable() if drafter_tokenizer is not None else None
    return Pair(
        _Untouchable(),
        target_tokenizer,
        drafter,
        drafter_tokenizer,
        target_name="tiny-target",
        context_length=context_length,
    )


@pytest.mark.real_models
def test_prompt_ids_per_rendering(real_tokenizers):
    tq, ts = real_tokenizers[QWEN], real_tokenizers[SMOL]
    pair = stub_pair(tq, ts)
    assert chat.prompt_ids(pair, "def f():") == (tq.encode("def f():"), ts.encode("def f():"))
    t_ids = chat.render_ids(tq, CONVERSATION)
    assert chat.prompt_ids(pair, messages=CONVERSATION, rendering="own") == (t_ids, chat.render_ids(ts, CONVERSATION))
    assert chat.prompt_ids(pair, messages=CONVERSATION, rendering="stripped") == (
        t_ids,
        chat.stripped_ids(tq, t_ids, ts),
    )
    assert chat.prompt_ids(stub_pair(tq, tq), messages=CONVERSATION) == (t_ids, t_ids)  # same tokenizer: same ids
    assert chat.prompt_ids(stub_pair(tq), messages=CONVERSATION) == (t_ids, None)  # no drafter


# ---------------------------------------------------------------------------------------------------------------------
# choose_rendering


def test_choose_rendering_tries_each_twice_then_keeps_the_better():
    memory = PairMemory()
    seen = []
    for accepted in (3, 2, 8, 6):  # own: 5/20, stripped: 14/20
        r = chat.choose_rendering(memory, "auto")
        seen.append(r)
        chat.record_rendering(memory, r, accepted, 10)
    assert seen == ["own", "own", "stripped", "stripped"]
    assert memory.rendering == {"own": RenderingTally(2, 5, 20), "stripped": RenderingTally(2, 14, 20)}
    assert chat.choose_rendering(memory, "auto") == "stripped"
    # it keeps measuring the one it uses, and changes its mind when the numbers do
    chat.record_rendering(memory, "stripped", 0, 40)
    assert chat.choose_rendering(memory, "auto") == "own"  # stripped: 14/60 < own: 5/20


def test_choose_rendering_ignores_generations_that_drafted_nothing():
    memory = PairMemory()
    chat.record_rendering(memory, "own", 0, 0)
    chat.record_rendering(memory, "own", 0, 0)
    assert chat.choose_rendering(memory, "auto") == "own"  # still untried
    assert "own" not in memory.rendering


def test_choose_rendering_explicit_and_invalid():
    memory = PairMemory(rendering={"own": [5, 1, 10], "stripped": [5, 9, 10]})
    assert chat.choose_rendering(memory, "own") == "own"
    assert chat.choose_rendering(memory, "stripped") == "stripped"
    with pytest.raises(ValueError, match="drafter rendering must be one of auto, own, stripped, got 'both'"):
        GenerationSettings(drafter_rendering="both")


@pytest.fixture(scope="module")
def tiny(real_tokenizers):
    """Tiny random models with the real Qwen (target) and SmolLM2 (drafter) tokenizers."""
    from tiny_pairs import tiny_pair

    tq, ts = real_tokenizers[QWEN], real_tokenizers[SMOL]
    target, drafter = tiny_pair(tq, ts, seed=1)
    return Pair(target, tq, drafter, ts)


@pytest.mark.real_models
def test_api_auto_rendering_alternates_and_never_changes_greedy_output(tiny):
    pair = tiny
    pair.memory.clear()
    outputs, tries, measured = [], [], []
    for _ in range(5):
        done = usd.generate(pair, messages=CONVERSATION, algorithm="tli", draft_tokens=3, max_new_tokens=6)
        assert done.stats.drafted > 0
        outputs.append(done.target_ids)
        seen = pair.memory.rendering
        tries.append({r: t.generations for r, t in seen.items()})
        measured.append({r: t.accepted / t.drafted for r, t in seen.items()})
    assert tries[:4] == [{"own": 1}, {"own": 2}, {"own": 2, "stripped": 1}, {"own": 2, "stripped": 2}]
    # the fifth uses the rendering whose drafts were accepted more often, as measured after the fourth
    better = max(("own", "stripped"), key=measured[3].get)
    assert tries[4] == {**tries[3], better: 3}
    plain = usd.generate(pair, messages=CONVERSATION, algorithm="none", max_new_tokens=6)
    assert all(o == plain.target_ids for o in outputs)


@pytest.mark.real_models
@pytest.mark.parametrize(("algorithm", "draft_tokens"), [("tli", 3), ("slem", "auto"), ("tli", "auto"), ("auto", 4)])
def test_a_seed_reproduces_its_sample_on_the_same_pair(tiny, algorithm, draft_tokens):
    """The same call with the same seed twice on one loaded pair (the app's "regenerate", `usd generate --samples`)."""
    pair = tiny
    pair.memory.clear()
    runs = [
        usd.generate(
            pair,
            "def add(a, b):\n    return",
            algorithm=algorithm,
            draft_tokens=draft_tokens,
            temperature=1.0,
            seed=5,
            max_new_tokens=12,
        ).target_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1], (
        "ENGINE BUG: with algorithm='auto' or draft_tokens='auto' the seed does not fix the sample. The schedule's "
        "state in pair.memory (the learned draft length, and auto's per-mode costs measured in wall-clock seconds; "
        "usd/schedule.py Schedule.__init__/next/observe) carries over to the next generation and changes how many "
        "random draws each position takes (tli samples the drafter, draws a uniform per candidate, resamples), so "
        f"the second run differs: {runs[0]} vs {runs[1]}"
    )


@pytest.mark.real_models
@pytest.mark.parametrize(("algorithm", "draft_tokens"), [("slem", 3), ("slem", "auto"), ("auto", "auto")])
def test_a_seed_gives_plain_decodings_sample_with_slem_and_auto(tiny, algorithm, draft_tokens):
    """The target draws each answer position with a generator keyed by (seed, position), so exact-match verification
    emits plain sampling's very tokens for a seed: the compare view shows the same text in both columns."""
    pair = tiny
    pair.memory.clear()  # auto tries every mode first; after other tests it may be waiting long to probe again
    if algorithm == "auto":
        # costs at load that make drafting free: with the tiny models' own, auto's probing budget in a 12-token answer
        # (2% of it) may rightly allow no draft at all, and then the seed's tokens would not be checked under drafting
        pair.memory.costs = LoadCosts(step_s=1e-3, c=0.0, v=dict.fromkeys(range(1, 17), 1.0), feed=1e-6)
    drafted = 0
    for seed in range(4):
        # top-k keeps CDF boundaries far apart: a k+1-token verify forward rounds differently from single steps
        # (1e-7), and on a flat 150k-token distribution a draw can land within that of a boundary
        kwargs = {"temperature": 1.0, "top_k": 8, "seed": seed, "max_new_tokens": 12}
        plain = usd.generate(pair, "def add(a, b):\n    return", algorithm="none", **kwargs)
        done = usd.generate(
            pair, "def add(a, b):\n    return", algorithm=algorithm, draft_tokens=draft_tokens, **kwargs
        )
        assert done.target_ids == plain.target_ids, f"seed {seed}"
        drafted += done.stats.drafted
    assert drafted > 0


# ---------------------------------------------------------------------------------------------------------------------
# API input errors: ValueError with a message saying what to change, before any model work


@pytest.fixture(scope="module")
def api_pair(real_tokenizers):
    return stub_pair(real_tokenizers[QWEN], real_tokenizers[SMOL], context_length=16)


BAD_INPUTS = [
    pytest.param(
        {"prompt": ""}, chat.PromptError, "the prompt is empty; type a question or some text to continue", id="empty"
    ),
    pytest.param({"prompt": " \n\t"}, chat.PromptError, "the prompt is empty", id="blank"),
    pytest.param({"prompt": None}, chat.PromptError, "the prompt is empty", id="none"),
    pytest.param(
        {"messages": [{"role": "user", "content": ""}]},
        chat.PromptError,
        "the last user message is empty",
        id="empty-chat",
    ),
    pytest.param(
        {"prompt": " ".join(["word"] * 40)},
        chat.PromptError,
        "the prompt is 40 tokens, longer than tiny-target's context of 16 tokens; shorten it or start a new chat",
        id="longer-than-context",
    ),
    pytest.param(
        {"prompt": " ".join(["word"] * 10), "max_new_tokens": 8},
        chat.PromptError,
        "the prompt (10 tokens) plus max new tokens (8) exceeds tiny-target's context of 16 tokens; lower "
        "max new tokens to at most 6 or shorten the prompt",
        id="too-long-with-the-answer",
    ),
    pytest.param(
        {"prompt": "Hi", "max_new_tokens": 0},
        ValueError,
        "max new tokens must be a whole number from 1 to 4,096, got 0",
        id="max-new-0",
    ),
    pytest.param(
        {"prompt": "Hi", "max_new_tokens": -3},
        ValueError,
        "max new tokens must be a whole number from 1 to 4,096, got -3",
        id="max-new-negative",
    ),
    pytest.param(
        {"prompt": "Hi", "max_new_tokens": True},
        ValueError,
        "max new tokens must be a whole number from 1 to 4,096, got True",
        id="max-new-bool",
    ),
    pytest.param(
        {"prompt": "Hi", "algorithm": "fast"},
        ValueError,
        "unknown algorithm 'fast'; choose one of auto, tli, slem, standard, ngram, suffix, none",
        id="unknown-algorithm",
    ),
    pytest.param(
        {"prompt": "Hi", "algorithm": "standard"},
        ValueError,
        "'standard' needs identical tokenizers; this pair differs, use tli, slem or auto",
        id="standard-across-vocabularies",
    ),
    pytest.param(
        {"prompt": "Hi", "draft_tokens": 65},
        ValueError,
        "draft tokens must be auto or a whole number from 1 to 16, got 65 (to decode without a drafter, use "
        "algorithm none)",
        id="k-65",
    ),
    pytest.param(
        {"prompt": "Hi", "temperature": -1.0},
        ValueError,
        "temperature must be a number from 0 (greedy) to 5, got -1.0",
        id="negative-temperature",
    ),
    pytest.param(
        {"prompt": "Hi", "top_p": 0.0},
        ValueError,
        "top-p must be a number above 0 and at most 1, got 0.0",
        id="top-p-0",
    ),
    pytest.param(
        {"prompt": "Hi", "drafter_rendering": "both"},
        ValueError,
        "drafter rendering must be one of auto, own, stripped, got 'both'",
        id="unknown-rendering",
    ),
    pytest.param(
        {"messages": CONVERSATION[:2]}, chat.PromptError, "the last message must be the user's", id="last-not-user"
    ),
    pytest.param({"messages": []}, chat.PromptError, "messages must be a non-empty list", id="no-messages"),
]


@pytest.mark.real_models
@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_INPUTS)
def test_api_input_errors(api_pair, kwargs, error, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(error) as e:
        usd.generate(api_pair, prompt, **kwargs)
    assert message in str(e.value)
    # the prompt is blamed only for the prompt: a bad setting is a ValueError, but not a PromptError
    assert isinstance(e.value, chat.PromptError) == (error is chat.PromptError)


@pytest.mark.real_models
def test_api_needs_a_drafter_for_speculation(real_tokenizers):
    pair = stub_pair(real_tokenizers[QWEN])
    with pytest.raises(ValueError, match="algorithm 'tli' needs a drafter model; load one, or use 'ngram'"):
        usd.generate(pair, "Hi", algorithm="tli")


# ---------------------------------------------------------------------------------------------------------------------
# `usd generate` on the real default pair: each call loads it (~10 s), so a handful of calls only


PROMPT = "def fibonacci(n):"
COMMON = ["--target", QWEN, "--drafter", SMOL, "--device", "cpu", "--precision", "fp32", "--max-new-tokens", "8"]
STATS_KEYS = {
    "algorithm",
    "rounds",
    "drafted",
    "accepted",
    "acceptance_rate",
    "tokens_per_round",
    "wall_s",
    "tokens_per_s",
    "stop_reason",
}


def generate_json(capsys, *args) -> dict:
    assert main(["generate", *args, *COMMON, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object, nothing else on stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def target_greedy(catalog, real_paths):
    """The target's own greedy answer (transformers' generate), 8 tokens, to compare the CLI with."""
    from usd.loading import load_model

    t = load_model(catalog.get(QWEN), device="cpu", precision="fp32", log=lambda m: None)

    @torch.no_grad()
    def answer(ids: list[int]) -> list[int]:
        out = t.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
        )[0, len(ids) :].tolist()
        eos = t.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) | {t.tokenizer.eos_token_id}
        return next((out[:i] for i, x in enumerate(out) if x in eos), out)

    return t.tokenizer, answer


@pytest.mark.real_models
def test_cli_generate_json_equals_plain_decoding(real_paths, capsys):
    spec = generate_json(capsys, "--prompt", PROMPT, "--algorithm", "tli", "--draft-tokens", "4")
    assert set(spec) == {"text", "target_token_ids", "stats"}
    assert set(spec["stats"]) >= STATS_KEYS
    s = spec["stats"]
    assert s["algorithm"] == "tli" and s["stop_reason"] in ("eos", "max_tokens") and s["drafted"] > 0
    assert 0 <= s["accepted"] <= s["drafted"] and s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
    assert s["tokens_per_round"] == pytest.approx(len(spec["target_token_ids"]) / s["rounds"])
    assert s["wall_s"] > 0 and s["tokens_per_s"] > 0
    assert len(spec["target_token_ids"]) == 8 or s["stop_reason"] == "eos"

    plain = generate_json(capsys, "--prompt", PROMPT, "--algorithm", "none")
    assert plain["stats"]["algorithm"] == "none" and plain["stats"]["drafted"] == 0
    assert spec["text"] == plain["text"] and spec["target_token_ids"] == plain["target_token_ids"]


@pytest.mark.real_models
def test_cli_samples_are_reproducible_from_the_seed(real_paths, capsys):
    # a fixed algorithm: with `auto` the mode of each round also follows measured timings (see the report)
    args = [
        "--prompt",
        PROMPT,
        "--algorithm",
        "tli",
        "--draft-tokens",
        "2",
        "--samples",
        "3",
        "--temperature",
        "0.8",
        "--seed",
        "5",
    ]
    first = generate_json(capsys, *args)
    again = generate_json(capsys, *args)
    assert set(first) == {"samples"} and len(first["samples"]) == 3
    for sample in first["samples"]:
        assert set(sample) == {"text", "target_token_ids", "stats"} and set(sample["stats"]) >= STATS_KEYS
        assert 0 < len(sample["target_token_ids"]) <= 8
    assert [(s["text"], s["target_token_ids"]) for s in first["samples"]] == [
        (s["text"], s["target_token_ids"]) for s in again["samples"]
    ]


@pytest.mark.real_models
def test_cli_messages_file_answers_the_conversation(real_paths, capsys, tmp_path, target_greedy):
    tok, answer = target_greedy
    f = tmp_path / "conversation.json"
    f.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    out = generate_json(capsys, "--messages-file", str(f))
    expected = answer(chat.render_ids(tok, CONVERSATION))
    assert out["target_token_ids"] == expected and out["text"] == tok.decode(expected)
    assert out["stats"]["algorithm"] == "auto"


@pytest.mark.real_models
def test_cli_chat_prints_the_answer(real_paths, capsys, target_greedy):
    tok, answer = target_greedy
    question = "What is 2 + 2?"
    assert main(["generate", "--prompt", question, "--chat", *COMMON]) == 0
    captured = capsys.readouterr()
    expected = tok.decode(answer(chat.render_ids(tok, [{"role": "user", "content": question}])))
    assert expected.strip() and "\ufffd" not in expected
    assert captured.out == expected + "\n"  # the answer streamed piece by piece, then a newline; nothing else
    assert "[auto: " in captured.err and "tokens/s" in captured.err and "stopped: " in captured.err
