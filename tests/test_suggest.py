"""`usd suggest`: the replay's acceptance is the decode loop's, the ranking orders and explains, the store remembers.

- Greedy tli and slem at draft length 1, replayed along the target's own answer without the target, make exactly the
  decisions `usd generate --algorithm A --draft-tokens 1` makes: the same accepted and drafted counts, on tiny pairs
  of every tokenizer kind (fast) and on the real qwen + smollm2 pair (slow).
- A drafter that shares no vocabulary and spells no bytes ranks last, saying why; a drafter whose c makes every k
  lose is marked slower than plain decoding; plain decoding is always a row.
- Real generations and `usd bench` runs add their accepted and tested positions to the store, and the ranking says
  how many tokens each alpha rests on.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from tiny_pairs import tiny_pair
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import usd
from usd import suggest
from usd.algorithms import Algorithm
from usd.datasets import Prompt
from usd.runners import OwnRunner
from usd.runners.transformers import Context
from usd.suggest import Acceptance, Measured, Model

PROMPTS = [
    Prompt("a", prompt="def fibonacci(n):"),
    Prompt("b", prompt="The capital of France is"),
    Prompt("c", prompt="Count: one two three"),
    Prompt("d", messages=({"role": "user", "content": "Écrivez une phrase"},)),
]


@pytest.fixture(autouse=True)
def scratch_store(tmp_path, monkeypatch):
    monkeypatch.setenv("USD_CHAT_CACHE", str(tmp_path))
    monkeypatch.setenv(suggest.RECORD_ENV, "1")


def generate_counts(target: Model, drafter: Model, prompt: Prompt, algorithm: str, n: int):
    pair = usd.Pair(target.model, target.tokenizer, drafter.model, drafter.tokenizer)
    kw = {"prompt": prompt.prompt} if prompt.prompt else {"messages": list(prompt.messages), "drafter_rendering": "own"}
    done = usd.generate(pair, **kw, algorithm=algorithm, draft_tokens=1, max_new_tokens=n)
    return done.stats.accepted, done.stats.drafted, list(done.target_ids)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_replay_counts_equal_the_decode_loops_on_tiny_pairs(tiny_tokenizers, kind, one_thread):
    t_tok, d_tok = tiny_tokenizers["target"], tiny_tokenizers[kind]
    t_model, d_model = tiny_pair(t_tok, d_tok, seed=0)
    target, drafter = Model("t", t_model, t_tok), Model("d", d_model, d_tok)
    refs = suggest.references(target, PROMPTS, 24)
    drafted, eos = 0, usd.Pair(t_model, t_tok).eos_ids()
    for ref in refs:
        for algorithm in ("tli", "slem"):
            got = suggest.replay(target, drafter, ref, algorithm)
            accepted, n, ids = generate_counts(target, drafter, ref.prompt, algorithm, 24)
            assert ids == [t for t in ref.answer if t not in eos]
            assert (got.accepted, got.drafted) == (accepted, n), (ref.prompt.id, algorithm)
            drafted += n
    assert drafted > 0


def no_shared_vocabulary_drafter() -> Model:
    """A word-level tokenizer over CJK characters: no token spells bytes a byte-level tokenizer has, so the shared
    vocabulary is empty (tli cannot run) and the drafter cannot write text (slem cannot either)."""
    vocab = {"</s>": 0, "<unk>": 1} | {ch: i + 2 for i, ch in enumerate("中文字词语句")}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=0,
    )
    return Model("no-vocab", LlamaForCausalLM(cfg).eval(), tok, family="fake")


def test_ranking_measures_tiny_drafters_and_puts_the_one_that_cannot_draft_last(tiny_tokenizers, one_thread):
    t_tok = tiny_tokenizers["target"]
    t_model, d_model = tiny_pair(t_tok, tiny_tokenizers["byte-level"], seed=0)
    models = {
        "t": Model("t", t_model, t_tok),
        "bl": Model("bl", d_model, tiny_tokenizers["byte-level"], "tiny"),
        "no-vocab": no_shared_vocabulary_drafter(),
    }
    loads = []

    def load(name):
        loads.append(name)
        return models[name]

    report = suggest.suggest("t", ["no-vocab", "bl"], load, suggest.PromptSet("tiny", PROMPTS[:2], 16))
    rows = {r["drafter"]: r for r in report["rows"]}
    assert report["rows"][-1]["drafter"] == "no-vocab"
    assert rows["no-vocab"]["expected_speedup"] is None
    note = rows["no-vocab"]["note"]
    assert "cannot draft" in note and "shares no vocabulary" in note and "spell no text" in note
    assert rows["(plain decoding)"]["expected_speedup"] == 1.0
    bl = rows["bl"]
    assert bl["c"] > 0 and set(bl["algorithms"]) >= {"tli", "slem"}
    assert bl["algorithms"]["tli"]["measured_tokens"] > 0 and 0 <= bl["algorithms"]["tli"]["sampled_alpha"] <= 1
    assert bl["expected_speedup"] is not None and 1 <= bl["best_k"] <= 8
    assert sorted(report["v"]) == list(range(1, 9))
    # measured once: a second ranking reads the cache (the target still loads, to know the machine)
    loads.clear()
    again = suggest.suggest("t", ["no-vocab", "bl"], load, suggest.PromptSet("tiny", PROMPTS[:2], 16))
    assert loads == ["t"] and [r["drafter"] for r in again["rows"]] == [r["drafter"] for r in report["rows"]]
    assert "| no-vocab |" in suggest.format_table(report)


class ContextOnly(OwnRunner):
    """A model as the llama.cpp runner (precision gguf) presents one, `usd/runners/llamacpp`'s LlamaCppModel: its
    own runner (`new_context`), a config with vocab_size and max_position_embeddings, device, dtype and
    generation_config, and nothing of the transformers model API (no forward call, parameters or output embeddings),
    so whatever reaches for those fails."""

    def __init__(self, model):
        self._model = model
        vocab = model.get_output_embeddings().weight.shape[0]
        n_ctx = model.config.max_position_embeddings
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=n_ctx)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.generation_config = model.generation_config

    def new_context(self, ids):
        return Context(self._model, ids)


MEASURED = ("alpha", "measured_tokens", "sampled_alpha")


@pytest.mark.parametrize("which", ["target", "both"])
def test_suggest_runs_through_the_context_interface_as_for_a_gguf_model(tiny_tokenizers, one_thread, which):
    """Every model forward of `usd suggest` goes through the decoding context, so a gguf model (the 1.5B target's
    catalog precision on a CPU) measures as a transformers one does: the same answers and the same acceptance."""
    t_tok, d_tok = tiny_tokenizers["target"], tiny_tokenizers["byte-level"]
    t_model, d_model = tiny_pair(t_tok, d_tok, seed=0)
    plain = {"t": Model("t", t_model, t_tok), "bl": Model("bl", d_model, d_tok, "tiny")}
    wrapped = {"t": Model("t", ContextOnly(t_model), t_tok), "bl": plain["bl"]}
    if which == "both":
        wrapped["bl"] = Model("bl", ContextOnly(d_model), d_tok, "tiny")
    assert not hasattr(wrapped["t"].model, "parameters") and not callable(wrapped["t"].model)
    expected = suggest.suggest("t", ["bl"], plain.__getitem__, suggest.PromptSet("tiny", PROMPTS[:2], 16))
    got = suggest.suggest(
        "t", ["bl"], wrapped.__getitem__, suggest.PromptSet("tiny", PROMPTS[:2], 16), precision="gguf"
    )
    assert got["machine"].endswith("/cpu/gguf/ContextOnly") and expected["machine"].endswith("/transformers")
    rows = [{r["drafter"]: r for r in report["rows"]}["bl"] for report in (expected, got)]
    for algorithm in ("tli", "slem"):
        a, b = ({key: row["algorithms"][algorithm][key] for key in MEASURED} for row in rows)
        assert a == b, algorithm
    assert rows[1]["c"] > 0 and sorted(got["v"]) == list(range(1, 9))
    refs = [suggest.references(m["t"], PROMPTS[:2], 16) for m in (plain, wrapped)]
    assert [r.answer for r in refs[0]] == [r.answer for r in refs[1]]
    # a drafter's numbers are kept per precision override: its runner changes c, which the target's machine hides
    assert any("|bl@gguf|" in key for key in json.loads(suggest.store_path().read_text())["measured"])


def test_a_drafter_whose_c_makes_every_k_lose_is_marked_slower_than_plain():
    v = {k: 1.0 + 0.05 * k for k in range(1, 9)}
    fast = Measured("fast", c=0.05, acceptance={"tli": Acceptance(60, 100)})
    slow = Measured("slow", c=0.9, acceptance={"tli": Acceptance(60, 100), "slem": Acceptance(70, 100)})
    rows = suggest.rank([slow, fast], v)
    assert [r["drafter"] for r in rows] == ["fast", "(plain decoding)", "slow"]
    # alpha 0.6, c 0.05: tau(0.6, k) / (0.05 k + 1 + 0.05 k) peaks at k = 3 (1.96 / 1.3)
    assert rows[0]["best_k"] == 3 and rows[0]["expected_speedup"] == pytest.approx((1 - 0.6**4) / 0.4 / 1.3)
    assert rows[2]["expected_speedup"] < 1 and "slower than plain decoding at every k" in rows[2]["note"]
    assert rows[2]["best_algorithm"] == "slem"


def rounds_of(events) -> tuple[int, int, int]:
    """(accepted, tested, drafted) over a generation's drafting rounds."""
    rounds = [e for e in events if isinstance(e, usd.Round) and e.drafted]
    accepted = sum(r.accepted for r in rounds)
    return accepted, sum(r.accepted + (r.accepted < r.drafted) for r in rounds), sum(r.drafted for r in rounds)


def test_use_refines_the_stored_acceptance_and_the_table_says_what_it_rests_on(tiny_tokenizers, one_thread):
    t_tok, d_tok = tiny_tokenizers["target"], tiny_tokenizers["byte-level"]
    t_model, d_model = tiny_pair(t_tok, d_tok, seed=0)
    pair = usd.Pair(t_model, t_tok, d_model, d_tok, target_name="t", drafter_name="bl")
    # the library only yields (it leaves no file behind); the app, the CLI and the server attach the recording
    usd.generate(pair, "def fibonacci(n):", algorithm="tli", max_new_tokens=8)
    assert not suggest.store_path().exists()
    accepted, tested, drafted = rounds_of(
        suggest.recording(
            pair, usd.stream(pair, "def fibonacci(n):", algorithm="tli", draft_tokens=4, max_new_tokens=16), True
        )
    )
    sampled = usd.stream(pair, "def fibonacci(n):", algorithm="tli", max_new_tokens=8, temperature=1.0, seed=1)
    list(suggest.recording(pair, sampled, greedy=False))
    stored = json.loads(suggest.store_path().read_text())[suggest.USE]["t|bl"]
    # per tested position, as auto's cost model counts: the candidates after a rejection were never tested
    assert stored["tli"] == [accepted, tested] and tested < drafted
    assert "tli@sampled" in stored  # kept apart: the ranking's alpha is greedy's
    suggest.record_acceptance("t", "bl", "tli", 5, 10)
    m = suggest.add_use(Measured("bl", c=0.1, acceptance={"tli": Acceptance(30, 40)}), "t")
    cell = suggest.rank([m], {k: 1.0 for k in range(1, 9)})[0]["algorithms"]["tli"]
    assert cell["tokens"] == 40 + tested + 10 and cell["used_tokens"] == tested + 10
    assert cell["alpha"] == pytest.approx((30 + accepted + 5) / cell["tokens"])


def test_a_bench_run_refines_the_stored_acceptance_once_per_generation(tiny_tokenizers, one_thread, monkeypatch):
    """`usd bench` records as chats do: each measured generation adds its accepted and tested positions per
    algorithm; its warm-up (the first prompt's opening again) adds nothing."""
    from usd.bench.run import bench

    t_tok, d_tok = tiny_tokenizers["target"], tiny_tokenizers["sentencepiece"]
    t_model, d_model = tiny_pair(t_tok, d_tok, seed=0)
    pair = usd.Pair(t_model, t_tok, d_model, d_tok, target_name="t", drafter_name="sp")
    prompts = [p for p in PROMPTS if p.prompt][:2]
    calls = []
    record = suggest.record_acceptance
    monkeypatch.setattr(suggest, "record_acceptance", lambda *a, **kw: (calls.append(a), record(*a, **kw)))
    result = bench(
        pair, prompts, [Algorithm.NONE, Algorithm.TLI, Algorithm.SLEM], k=3, max_new_tokens=12, log=lambda *_: None
    )
    runs = [r for r in result["prompts"] if r["drafted"]]
    assert len(calls) == len(runs) == 2 * len(prompts)  # once per finished generation and algorithm
    stored = suggest.used_acceptance("t", "sp")
    assert set(stored) == {"tli", "slem"}
    monkeypatch.setenv(suggest.RECORD_ENV, "0")  # the same generations again, counted here rather than stored
    for algorithm in ("tli", "slem"):
        expected = [0, 0]
        for r in (r for r in runs if r["algorithm"] == algorithm):
            prompt = next(p.prompt for p in prompts if p.id == r["prompt"])
            accepted, tested, _ = rounds_of(
                usd.stream(pair, prompt, algorithm=algorithm, draft_tokens=3, max_new_tokens=12)
            )
            assert accepted == r["accepted"]
            expected = [expected[0] + accepted, expected[1] + tested]
        assert stored[algorithm] == expected, algorithm


def test_a_cached_measurement_of_before_use_was_counted_per_tested_position_still_reads():
    old = {"drafter": "d", "acceptance": {"tli": {"accepted": 3, "drafted": 4, "used_accepted": 0, "used_drafted": 0}}}
    assert suggest.Measured.from_dict(old).acceptance["tli"] == Acceptance(3, 4)


def test_nothing_is_recorded_when_recording_is_off(monkeypatch):
    monkeypatch.setenv(suggest.RECORD_ENV, "0")
    suggest.record_acceptance("t", "d", "tli", 1, 2)
    assert not suggest.store_path().exists()


def test_cli_says_what_is_wrong_before_loading(capsys):
    from usd.cli import main

    assert main(["suggest", "--drafters", "smollm2-135m-instruct", "--limit", "0"]) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err
    assert main(["suggest", "--drafters", "x", "--prompts", "/no/such.jsonl"]) == 2
    assert "neither humaneval, mtbench, edits, recall nor a JSONL file" in capsys.readouterr().err


# --- the real pair ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pair(real_paths):
    from usd.loading import load_model

    log = lambda *_: None  # noqa: E731
    t = load_model("qwen2.5-coder-0.5b-instruct", precision="fp32", log=log)
    d = load_model("smollm2-135m-instruct", precision="fp32", log=log)
    return Model(t.name, t.model, t.tokenizer), Model(d.name, d.model, d.tokenizer)


@pytest.mark.real_models
def test_replay_acceptance_equals_generate_draft_tokens_1_on_the_real_pair(real_pair):
    """The acceptance `usd generate --algorithm tli --draft-tokens 1` measures, exactly, on code and chat prompts."""
    target, drafter = real_pair
    prompts = [*suggest.PROMPT_SETS["code"][:2], suggest.PROMPT_SETS["chat"][0]]
    refs = suggest.references(target, prompts, 32)
    totals = {"tli": [0, 0, 0, 0], "slem": [0, 0, 0, 0]}
    eos = usd.Pair(target.model, target.tokenizer).eos_ids()  # once: a Pair reads its tokenizer's whole vocabulary
    for ref in refs:
        for algorithm in ("tli", "slem"):
            got = suggest.replay(target, drafter, ref, algorithm)
            accepted, drafted, ids = generate_counts(target, drafter, ref.prompt, algorithm, 32)
            print(ref.prompt.id, algorithm, (got.accepted, got.drafted), (accepted, drafted), flush=True)
            assert ids == [t for t in ref.answer if t not in eos]
            assert (got.accepted, got.drafted) == (accepted, drafted), (ref.prompt.id, algorithm)
            totals[algorithm] = [
                x + y for x, y in zip(totals[algorithm], (got.accepted, got.drafted, accepted, drafted), strict=True)
            ]
    assert totals["tli"][1] > 30 and 0 < totals["tli"][0] < totals["tli"][1]


# --- the Pair tab -----------------------------------------------------------------------------------------------------


def test_pair_tab_ranking_handler_shows_table_chart_and_loadable_picks(catalog, monkeypatch):
    """The handler behind "Rank drafters for this target", on numbers given here (the browser test runs it for real,
    tests/test_app.py)."""
    import gradio as gr

    from app import suggest_ui
    from app.handlers import Handlers
    from app.pairs import Pairs
    from app.ui import build

    v = {k: 1.0 + 0.1 * k for k in range(1, 9)}
    measured = [
        Measured(
            "gemma-3-270m",
            family="gemma3",
            tokenizer="sentencepiece",
            shared=95934,
            shared_pct_target=63.1,
            alpha_ceiling=0.9,
            c=0.05,
            acceptance={"slem": Acceptance(7, 10)},
        ),
        Measured("smollm2-135m-instruct", c=0.9, acceptance={"tli": Acceptance(5, 10)}),
        Measured("no-vocab", unavailable=dict.fromkeys(suggest.ALGORITHMS, "no")),
    ]
    seen = {}

    def fake_suggest(target, drafters, load, on, progress, **_):
        seen.update(target=target, drafters=drafters, key=on.key)
        progress(0.5, "measuring")
        return {
            "target": target,
            "prompts": on.key,
            "machine": "here",
            "v": v,
            "step_s": 0.05,
            "rows": suggest.rank(measured, v),
        }

    monkeypatch.setattr(suggest, "suggest", fake_suggest)
    monkeypatch.setattr(suggest, "candidates", lambda cat, t: ["gemma-3-270m", "smollm2-135m-instruct", "no-vocab"])
    pairs = Pairs(catalog)
    pairs.allowed = [*pairs.allowed, "no-vocab"]
    h = Handlers(pairs)
    df, bars, pick, message = suggest_ui.rank_drafters(h, "qwen2.5-coder-0.5b-instruct", "", lambda *a, **k: None)
    assert seen == {
        "target": "qwen2.5-coder-0.5b-instruct",
        "key": "code",
        "drafters": ["gemma-3-270m", "smollm2-135m-instruct", "no-vocab"],
    }
    assert list(df["drafter"]) == ["gemma-3-270m", "(plain decoding)", "smollm2-135m-instruct", "no-vocab"]
    assert df["expected speedup"].iloc[1] == "1.00" and "slower than plain" in df["note"].iloc[2]
    assert "cannot draft" in df["note"].iloc[3]
    assert list(bars["drafter"]) == ["gemma-3-270m", "(plain decoding)", "smollm2-135m-instruct"]
    assert pick["choices"] == ["gemma-3-270m", "smollm2-135m-instruct"] and pick["value"] == "gemma-3-270m"
    assert "Ranked 3 drafter(s)" in message
    _, _, _, bad = suggest_ui.rank_drafters(h, "no-such-model", "", lambda *a, **k: None)
    assert bad.startswith("⚠") and "unknown target" in bad
    buttons = {b.elem_id for b in build(pairs).demo.blocks.values() if isinstance(b, gr.Button)}
    assert {"rank-run", "rank-load"} <= buttons
