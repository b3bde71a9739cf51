"""The app's pure parts on hand-made events: spans, stats, warning, compare summary, settings, sessions, Space mode."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from app import render
from app.handlers import Cancels, InputError, _text, prompt_text, settings
from app.pairs import NO_DRAFTER, Pairs, SpaceModeError
from app.space import SPACE_MODELS_ENV, SpaceModelsError, space_mode
from usd.algorithms import Algorithm
from usd.events import Finished, Piece, Round, Stats
from usd.loading import LoadError
from usd.theory import expected_speedup

ROOT = Path(__file__).resolve().parent.parent


def piece(text, kind, rnd, tid=1, dids=()):
    return Piece(text, kind, tid, rnd, tuple(dids))


def plain_round(i, text="a", verify_s=0.1):
    return Round(i, 0, (piece(text, "target", i),), 0, 0, 0.0, verify_s, 0.0, "none")


def spec_round(i, accepted_texts, rejected_texts, last, last_kind, draft_s=0.2, verify_s=0.15, k=4):
    pieces = [piece(t, "accepted", i, 10 + j, (20 + j,)) for j, t in enumerate(accepted_texts)]
    pieces += [piece(t, "rejected", i, 30 + j, (40 + j,)) for j, t in enumerate(rejected_texts)]
    pieces.append(piece(last, last_kind, i, 50))
    drafted = len(accepted_texts) + len(rejected_texts)
    return Round(i, k, tuple(pieces), drafted, len(accepted_texts), draft_s, verify_s, 0.0, "tli")


def with_stats(rounds):
    """The rounds as the engine yields them: each carries the running stats, counted by the engine's own Tally."""
    import dataclasses

    from usd.record import RoundRecord
    from usd.tally import Tally

    tally, tokens, out = Tally("tli"), 0, []
    for r in rounds:
        tally.record(RoundRecord(r.algorithm, r.k, r.drafted, r.accepted, r.drafted, r.draft_s, r.verify_s))
        tokens += len(r.emitted)
        out.append(dataclasses.replace(r, draft_steps=r.drafted, stats=tally.stats(tokens, None, 0.0, None)))
    return out


def test_every_kind_gets_its_class_rejected_is_struck_and_hover_gives_round_and_ids():
    pieces = [
        piece("Hi", "target", 0, 7),
        piece(" there", "accepted", 1, 8, (3, 4)),
        piece("!", "rejected", 1, 9, (5,)),
        piece(".", "resampled", 1, 11),
        piece(" ok", "bonus", 2, 12),
    ]
    out = render.pieces_html(pieces)
    for kind in ("target", "accepted", "rejected", "resampled", "bonus"):
        assert f"tok-{kind}" in out
    assert re.search(r'<s class="tok tok-rejected"[^>]*>!</s>', out)
    assert 'title="round 1 · accepted · target id 8, drafter ids 3, 4"' in out
    assert 'title="round 0 · target · target id 7"' in out
    # document order is generation order
    kinds = re.findall(r'data-kind="(\w+)"', out)
    assert kinds == ["target", "accepted", "rejected", "resampled", "bonus"]


def test_text_is_escaped_blank_tokens_marked_and_empty_pieces_skipped():
    out = render.pieces_html(
        [piece("<script>alert(1)</script>", "target", 0), piece("  ", "target", 1), piece("", "target", 2)]
    )
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "tok-blank" in out
    assert out.count('class="tok tok-') == 2
    with pytest.raises(ValueError, match="unknown piece kind"):
        render.piece_span(piece("x", "weird", 0))


def test_legend_names_every_kind():
    out = render.legend_html()
    for kind in ("accepted", "rejected", "resampled", "bonus", "target"):
        assert f'class="tok tok-{kind}"' in out
    assert "tok-lookup" in out and "n-gram lookup" in out  # the lookup's mark, apart from the drafter model's


def test_live_numbers_follow_the_rounds():
    live = render.Live(Algorithm.TLI)
    for r in with_stats(
        [
            plain_round(0, verify_s=0.1),
            spec_round(1, ["a", "b"], ["c", "d"], "e", "resampled", draft_s=0.2, verify_s=0.15),
            spec_round(2, ["f", "g", "h", "i"], [], "j", "bonus", draft_s=0.2, verify_s=0.15),
        ]
    ):
        live.add(r)
    n = live.numbers()
    assert n["acceptance_rate"] == pytest.approx(6 / 8)
    assert n["tokens"] == 1 + 3 + 5 and n["rounds"] == 3
    assert n["tokens_per_round"] == pytest.approx(9 / 3)
    assert n["k"] == 4
    assert n["c"] == pytest.approx(0.05 / 0.1)
    assert n["v"] == pytest.approx(1.5)
    assert n["theoretical_speedup"] == pytest.approx(expected_speedup(0.75, 4, 0.5, 1.5))
    assert n["speedup_basis"].startswith("estimated")
    assert render.answer_text(live) == "aabefghij"
    assert [accepted for _, accepted, _ in live.chart] == [0, 2, 4]
    assert [emitted for _, _, emitted in live.chart] == [1, 3, 5]


def test_finished_stats_replace_the_running_estimate_and_a_baseline_gives_measured_speedup():
    live = render.Live(Algorithm.TLI, baseline_tokens_per_s=10.0)
    live.add(with_stats([spec_round(0, ["a"], ["b"], "c", "resampled")])[0])
    stats = Stats(
        "tli", rounds=4, drafted=10, accepted=5, tokens=12, wall_s=2.0, stop_reason="eos", c=0.3, v=1.2, mean_k=2.5
    )
    live.add(Finished("final text", (1, 2), stats))
    n = live.numbers()
    assert n["tokens_per_s"] == 6.0 and n["acceptance_rate"] == 0.5 and n["stop_reason"] == "eos"
    assert n["measured_speedup"] == pytest.approx(0.6) and n["speedup_basis"].startswith("against plain decoding")
    assert render.answer_text(live) == "final text"


def test_without_a_plain_run_the_estimated_speedup_counts_the_prompt_plain_decoding_reads_too():
    # 12 tokens at 0.1 s a plain step after the prompt's 0.8 s: plain decoding takes this answer's 2.0 s too
    stats = Stats(
        "auto", rounds=8, drafted=6, accepted=4, tokens=12, wall_s=2.0, stop_reason="max_tokens", c=0.3, v=1.2,
        mean_k=2.0, rounds_by_algorithm={"none": 5, "tli": 3}, step_s=0.1, prompt_s=0.8,
    )  # fmt: skip
    live = render.Live(Algorithm.AUTO)
    live.add(Finished("t", (1, 2), stats))
    n = live.numbers()
    assert n["speedup_basis"] == "estimated from the target's plain step"
    assert n["measured_speedup"] == pytest.approx(1.0)
    assert render.warning_text(n, Algorithm.AUTO) is None  # no loss, so no warning on a first answer's long prompt


def test_warning_only_when_speculation_is_slower():
    slow = {"measured_speedup": 0.7, "c": 0.45, "acceptance_rate": 0.4}
    text = render.warning_text(slow, Algorithm.TLI)
    assert "slowing this pair down" in text and "0.70x" in text and "0.45" in text
    assert render.warning_text(slow, Algorithm.NONE) is None
    assert render.warning_text({"measured_speedup": 1.3}, Algorithm.TLI) is None
    assert render.warning_text({"measured_speedup": None}, Algorithm.TLI) is None
    assert "slow-warning" in render.stats_html(slow, Algorithm.TLI)
    assert "slow-warning" not in render.stats_html({"measured_speedup": 1.2}, Algorithm.TLI)
    assert render.stats_html({}, Algorithm.AUTO).count("–") >= 6  # unknowns are shown as such, not as zeros


def _finished(ids, wall_s, algorithm="tli"):
    return Finished("t", tuple(ids), Stats(algorithm, 3, 4, 2, len(ids), wall_s, "eos", 0.3, 1.2, 2.0))


def test_compare_summary():
    s = render.compare_summary(_finished([1, 2, 3], 2.0, "none"), _finished([1, 2, 3], 1.0), greedy=True)
    assert s["identical"] and s["speedup"] == 2.0 and s["plain_s"] == 2.0 and s["speculative_s"] == 1.0
    assert "token-identical" in render.summary_html(s)
    s = render.compare_summary(_finished([1, 2, 3], 1.0, "none"), _finished([1, 5, 3], 2.0), greedy=True)
    assert not s["identical"] and s["first_difference"] == 1 and s["speedup"] == 0.5
    assert "must be identical" in render.summary_html(s)
    s = render.compare_summary(_finished([1, 2], 1.0, "none"), _finished([1, 2, 3], 1.0), greedy=False)
    assert s["first_difference"] == 2 and "distribution" in render.summary_html(s)


class _StubPair(str):
    """A pair with no model, known by its name."""

    def fills_cpu(self) -> bool:
        return False


class _StubPairs:
    """The part of app.pairs.Pairs the handlers use while generating, with no model."""

    def __init__(self):
        self.baselines = {}

    def current(self):
        return _StubPair("the pair")

    def key(self):
        return ("target", "drafter")


def _fake_engine(monkeypatch, speculative_ids):
    """api.stream answers [1, 2, 3] plain and `speculative_ids` otherwise; returns the settings it was given and the
    divergence questions asked."""
    from app import handlers
    from usd.numerics import Divergence

    streamed, asked = [], []

    def stream(pair, prompt=None, *, settings, cancel, **_):
        streamed.append(settings)
        yield _finished([1, 2, 3] if settings.algorithm == "none" else speculative_ids, 1.0, settings.algorithm)

    def divergence(pair, ids, position, *, messages):
        asked.append((pair, tuple(ids), position, messages))
        return Divergence(position, 0.01, 0.05, "bfloat16")

    monkeypatch.setattr(handlers.api, "stream", stream)
    monkeypatch.setattr(handlers.api, "divergence", divergence)
    return streamed, asked


def test_compare_asks_the_target_about_a_greedy_difference(monkeypatch):
    from app.handlers import Handlers

    streamed, asked = _fake_engine(monkeypatch, [1, 5, 3])
    *_, (_, _, summary) = Handlers(_StubPairs()).compare_stream("hi", settings("tli", "4", 0, 1, 0, None, 8))
    assert [(s.algorithm, s.draft_tokens) for s in streamed] == [("none", "auto"), ("tli", 4)]
    assert asked == [("the pair", (1, 2, 3), 1, [{"role": "user", "content": "hi"}])]
    assert summary["first_difference"] == 1 and summary["near_tie"] is True


def test_compare_samples_both_columns_with_one_seed_and_asks_nothing(monkeypatch):
    from app.handlers import Handlers

    streamed, asked = _fake_engine(monkeypatch, [1, 5, 3])
    *_, (_, _, summary) = Handlers(_StubPairs()).compare_stream("hi", settings("slem", "auto", 0.8, 1, 0, None, 8))
    assert streamed[0].seed is not None and streamed[0].seed == streamed[1].seed
    assert not asked and summary["near_tie"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("fast", "auto", 0, 1, 0, None, 10), "unknown algorithm"),
        (("auto", "17", 0, 1, 0, None, 10), "draft tokens must be auto or a whole number from 1 to 16"),
        (("auto", "0", 0, 1, 0, None, 10), "from 1 to 16"),
        (("auto", "auto", -1, 1, 0, None, 10), "temperature must be a number from 0 (greedy) to 5, got -1"),
        (("auto", "auto", 0, 0, 0, None, 10), "top-p must be a number above 0 and at most 1, got 0"),
        (("auto", "auto", 0, 1, -3, None, 10), "top-k must be a whole number"),
        (("auto", "auto", 0, 1, 0, -1, 10), "seed must be a whole number"),
        (("auto", "auto", 0, 1, 0, None, 0), "max new tokens must be a whole number from 1 to 4,096"),
        (("auto", "auto", 0, 1, 0, None, 5000), "max new tokens must be a whole number from 1 to 4,096"),
        (("auto", "auto", 0, 1, 0, None, 2.5), "max new tokens must be a whole number"),
        (("auto", "auto", 0, 1, 0, None, "many"), "max new tokens must be a whole number from 1 to 4,096, got 'many'"),
        # API callers can send any text or JSON: each gets a message naming the setting and its range
        (("auto", "auto", 0, 1, 0, None, "inf"), "max new tokens must be a whole number from 1 to 4,096, got 'inf'"),
        (("auto", "auto", 0, 1, 0, None, float("inf")), "max new tokens must be a whole number from 1 to 4,096"),
        (("auto", "auto", 0, 1, 0, None, "nan"), "max new tokens must be a whole number from 1 to 4,096, got 'nan'"),
        (("auto", "auto", 0, 1, 0, None, "1e400"), "max new tokens must be a whole number from 1 to 4,096"),
        (("auto", "auto", 0, 1, 0, None, [5]), "max new tokens must be a whole number from 1 to 4,096, got [5]"),
        (("auto", "auto", 0, 1, "inf", None, 10), "top-k must be a whole number from 0 to"),
        (("auto", "auto", 0, 1, 0, "inf", 10), "seed must be a whole number from 0 to"),
        (("auto", "auto", 0, 1, 0, "nan", 10), "seed must be a whole number from 0 to"),
        (("auto", "²", 0, 1, 0, None, 10), "draft tokens must be auto or a whole number from 1 to 16, got '²'"),
        (("auto", "auto", "abc", 1, 0, None, 10), "temperature must be a number from 0 (greedy) to 5, got 'abc'"),
        (("auto", "auto", "nan", 1, 0, None, 10), "temperature must be a number from 0 (greedy) to 5, got 'nan'"),
        (("auto", "auto", {}, 1, 0, None, 10), "temperature must be a number from 0 (greedy) to 5, got {}"),
        (("auto", "auto", 0, "abc", 0, None, 10), "top-p must be a number above 0 and at most 1, got 'abc'"),
        (("auto", "auto", 0, "inf", 0, None, 10), "top-p must be a number above 0 and at most 1, got 'inf'"),
        ((7, "auto", 0, 1, 0, None, 10), "unknown algorithm '7'"),
    ],
)
def test_settings_errors_say_what_to_change(args, message):
    with pytest.raises(InputError, match=re.escape(message)):
        settings(*args)


def test_settings_accept_what_the_widgets_send():
    s = settings("slem", "4", 0.7, 0.9, 20.0, 3.0, 64.0).model_dump(exclude={"stop_strings", "drafter_rendering"})
    assert s == {
        "algorithm": "slem",
        "draft_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 3,
        "max_new_tokens": 64,
    }
    assert settings(None, None, None, None, None, "", None).max_new_tokens == 256


def test_settings_keep_big_seeds_exact():
    assert settings("auto", "auto", 0, 1, 0, str((1 << 63) - 1), 10).seed == (1 << 63) - 1
    assert settings("auto", "auto", 0, 1, 0, 12345678901234567, 10).seed == 12345678901234567


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (123, "the prompt must be text, got a number"),
        (1.5, "the prompt must be text, got a number"),
        (["hi"], "the prompt must be text, got a list"),
        ("  ", "the prompt is empty"),
    ],
)
def test_a_prompt_that_is_not_text_says_so(prompt, message):
    with pytest.raises(InputError, match=message):
        prompt_text(prompt)


def test_message_text_from_either_content_form():
    assert _text("hi") == "hi"
    assert _text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert _text({"type": "text", "text": "c"}) == "c"


def test_stop_cancels_only_its_own_session():
    c = Cancels()
    a, b = c.start("a"), c.start("b")
    assert c.stop("a") and a.is_set() and not b.is_set()
    c.end("a", a)
    assert not c.stop("a")


def test_space_mode_from_environment(monkeypatch):
    monkeypatch.delenv("USD_CHAT_SPACE", raising=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert not space_mode()
    monkeypatch.setenv("SPACE_ID", "someone/usd-chat")
    assert space_mode()
    monkeypatch.setenv("USD_CHAT_SPACE", "0")
    assert not space_mode()
    monkeypatch.setenv("USD_CHAT_SPACE", "1")
    monkeypatch.delenv("SPACE_ID")
    assert space_mode()


def test_space_mode_allows_catalog_models_only(catalog, tmp_path):
    pairs = Pairs(catalog, space_mode=True)
    assert pairs.entry("smollm2-135m-instruct", "drafter").name == "smollm2-135m-instruct"
    for spec in (str(tmp_path), "someone/some-model", "nope"):
        with pytest.raises(SpaceModeError, match="this Space serves only its catalog models"):
            pairs.entry(spec, "target")
    assert "only its catalog models" in pairs.preview(str(tmp_path), "smollm2-135m-instruct")
    local = Pairs(catalog, space_mode=False)
    assert local.entry(str(tmp_path), "target").source.kind == "path"
    with pytest.raises(LoadError, match="unknown target"):
        local.entry("no such model", "target")
    with pytest.raises(LoadError, match="no drafter chosen"):
        local.entry(" ", "drafter")
    with pytest.raises(LoadError, match="no pair is loaded"):
        local.current()


BIG = "qwen2.5-32b-instruct"  # about 65 GB on the hub, not gated: a public Space must not fetch it on request


def _no_loading(monkeypatch):
    from usd import api

    def load_pair(*args, **kwargs):
        raise AssertionError("a refused model must not reach the loader (which would download it)")

    monkeypatch.setattr(api, "load_pair", load_pair)


def test_space_serves_only_the_models_its_deployer_lists(catalog, monkeypatch):
    monkeypatch.setenv(SPACE_MODELS_ENV, " qwen2.5-0.5b-instruct ,gemma-3-270m")
    _no_loading(monkeypatch)
    pairs = Pairs(catalog, space_mode=True)
    default = {catalog.default.target, catalog.default.drafter}  # the pair the Space loads at start
    assert set(pairs.allowed) == default | {"qwen2.5-0.5b-instruct", "gemma-3-270m"}
    assert pairs.entry("gemma-3-270m", "drafter").name == "gemma-3-270m"
    refusal = rf"target '{BIG}' is not served by this Space; it serves only .*qwen2.5-0.5b-instruct"
    with pytest.raises(SpaceModeError, match=refusal):
        pairs.entry(BIG, "target")
    with pytest.raises(SpaceModeError, match=refusal):
        pairs.load(BIG, "qwen2.5-0.5b-instruct", log=lambda *_: None)
    assert f"'{BIG}' is not served by this Space" in pairs.preview(BIG, "gemma-3-270m")


def test_space_without_a_list_serves_the_models_on_disk(catalog, monkeypatch):
    import app.space

    monkeypatch.delenv(SPACE_MODELS_ENV, raising=False)
    monkeypatch.setattr(app.space, "local_path", lambda e: ROOT if e.name == "mistral-7b-instruct-v0.3" else None)
    _no_loading(monkeypatch)
    pairs = Pairs(catalog, space_mode=True)
    assert set(pairs.allowed) == {catalog.default.target, catalog.default.drafter, "mistral-7b-instruct-v0.3"}
    with pytest.raises(SpaceModeError, match=f"target '{BIG}' is not served by this Space"):
        pairs.load(BIG, catalog.default.drafter, log=lambda *_: None)
    assert Pairs(catalog, space_mode=False).allowed == catalog.names()


def test_space_list_naming_an_unknown_model_is_a_startup_error(catalog, monkeypatch):
    monkeypatch.setenv(SPACE_MODELS_ENV, "gemma-3-270m,qwen-99b")
    with pytest.raises(SpaceModelsError, match=f"{SPACE_MODELS_ENV} names 'qwen-99b', which is not in the catalog"):
        Pairs(catalog, space_mode=True)


def test_the_app_reports_a_bad_space_list_without_a_traceback(monkeypatch, capsys):
    import app.__main__ as main_mod

    monkeypatch.setenv("USD_CHAT_SPACE", "1")
    monkeypatch.setenv(SPACE_MODELS_ENV, "qwen-99b")
    monkeypatch.setattr(main_mod, "launch", lambda *a, **k: pytest.fail("must not launch"))
    with pytest.raises(SystemExit) as exit_:
        main_mod.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{SPACE_MODELS_ENV} names 'qwen-99b', which is not in the catalog" in err and "Traceback" not in err


def test_space_pair_tab_lists_only_the_served_models(catalog, monkeypatch):
    import gradio as gr

    from app.ui import build

    monkeypatch.setenv(SPACE_MODELS_ENV, "qwen2.5-0.5b-instruct")
    pairs = Pairs(catalog, space_mode=True)
    dropdowns = {b.label: b for b in build(pairs).demo.blocks.values() if isinstance(b, gr.Dropdown)}
    assert [value for _, value in dropdowns["Target"].choices] == pairs.allowed
    assert [value for _, value in dropdowns["Drafter"].choices] == [NO_DRAFTER, *pairs.allowed]  # a model optional
    suggested = [value.split(":")[0] for _, value in dropdowns["Suggested pairs"].choices]
    assert suggested == [f"{catalog.default.target} ← {catalog.default.drafter}"]  # the only one of served models


def test_the_pair_tab_loads_a_target_without_a_drafter_model_and_says_what_it_can_do(catalog, monkeypatch):
    """A drafter model is optional (issue 25): ngram drafts by looking up the conversation. The preview says so,
    the load asks for the target alone, and the header names no drafter."""
    from usd import api

    loads = []
    monkeypatch.setattr(api, "load_pair", lambda target, drafter, **kw: loads.append((target, drafter)) or "a pair")
    pairs = Pairs(catalog, device="cpu")
    text = pairs.preview(catalog.default.target, NO_DRAFTER)
    assert "**drafter**: none" in text and "`ngram` drafts by looking up the conversation" in text
    assert "for the target" in text and "alpha ceiling" not in text.lower()
    assert pairs.load(catalog.default.target, NO_DRAFTER, log=lambda *_: None) == "a pair"
    assert loads == [(catalog.default.target, False)]
    assert pairs.describe().endswith("no drafter model (ngram and plain decoding)")


def test_the_pair_preview_says_which_model_a_load_will_convert_first(catalog, monkeypatch, tmp_path):
    import app.pairs
    from usd.runners import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    # both fetched, neither converted: a GGUF model on llama.cpp is ready, one on transformers converts at its load
    monkeypatch.setattr(app.pairs, "local_path", lambda entry, converted=False: None if converted else tmp_path)
    text = Pairs(catalog, device="cpu").preview("gemma-3-270m", "smollm2-135m-instruct")
    gemma, smol = (line for line in text.splitlines() if line.startswith("- **target**") or "**drafter**" in line)
    assert "converted to float32 for transformers at its first load" in gemma
    assert "gguf on cpu" in smol and "(ready)" in smol


def test_launch_defaults_to_localhost_without_share(monkeypatch):
    import app.__main__ as main_mod

    seen = {}
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.setattr(main_mod, "create", lambda *a, **k: ("demo", None))
    monkeypatch.setattr(
        main_mod, "launch", lambda demo, host, port, share, *rest: seen.update(host=host, share=share, port=port)
    )
    assert main_mod.main([]) == 0
    assert seen == {"host": "127.0.0.1", "share": False, "port": 7860}
    main_mod.main(["--host", "0.0.0.0", "--port", "9000", "--share"])
    assert seen == {"host": "0.0.0.0", "share": True, "port": 9000}


def _front_matter() -> dict:
    import yaml

    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "README.md must open with the Space's front matter"
    return yaml.safe_load(text.split("---\n")[1])


def test_space_front_matter_names_an_app_file_that_exists_and_this_gradio():
    import gradio

    fm = _front_matter()
    assert fm["sdk"] == "gradio" and str(fm["python_version"]) == "3.11"
    assert (ROOT / fm["app_file"]).is_file()
    assert fm["sdk_version"].split(".")[0] == gradio.__version__.split(".")[0]
    assert {"Qwen/Qwen2.5-Coder-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"} <= set(fm["models"])


def test_space_requirements_match_the_package_dependencies():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["llamacpp"]
    wanted = {d.split("#")[0].strip() for d in deps if not d.startswith("gradio")}
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    have = {
        ln.split(" --")[0].strip() for ln in lines if ln.strip() and not ln.startswith("#")
    }  # without pip's options
    assert have == wanted


def test_background_stream_keeps_order_raises_errors_and_cancels_when_abandoned():
    import threading

    from app.views import in_background

    cancel = threading.Event()
    batches = list(in_background(lambda: iter(range(50)), cancel, 0.5))
    assert [x for b in batches for x in b] == list(range(50))

    def failing():
        yield 1
        raise ValueError("the prompt is empty")

    with pytest.raises(ValueError, match="the prompt is empty"):
        list(in_background(failing, threading.Event(), 0.5))

    cancel = threading.Event()
    started = threading.Event()

    def endless():
        while not cancel.is_set():  # like the decode loop, which checks its cancel flag every round
            started.set()
            time.sleep(0.001)
            yield 0

    stream = in_background(endless, cancel, 0.5)
    next(stream)
    stream.close()  # the browser went away: the loop must end, not run on
    assert started.is_set() and cancel.is_set()


def test_the_stats_say_in_words_what_auto_chose_and_why():
    declined = Round(3, 0, (piece("x", "target", 3),), 0, 0, 0.0, 0.1, 0.0, "none", declined=("tli", 1, 0.74))
    live = render.Live(Algorithm.AUTO)
    live.add(declined)
    text = render.stats_html(live.numbers(), Algorithm.AUTO)
    assert "plain decoding: the best speculation, tli k=1, is expected at 0.74x" in text
    assert "speculation does not pay on this machine" in text
    live.add(Round(4, 3, (piece("y", "accepted", 4),), 3, 1, 0.01, 0.1, 0.0, "slem", expected_speedup=1.31))
    assert "slem k=3 (the drafter model), expected 1.31x" in render.stats_html(live.numbers(), Algorithm.AUTO)
    live.add(Round(5, 2, (piece("z", "accepted", 5),), 2, 2, 0.0, 0.1, 0.0, "ngram", expected_speedup=1.2))
    assert "ngram k=2 (n-gram lookup, no model), expected 1.20x" in render.stats_html(live.numbers(), Algorithm.AUTO)
    plain = render.Live(Algorithm.TLI)
    plain.add(declined)
    assert "auto&#x27;s choice" not in render.stats_html(plain.numbers(), Algorithm.TLI)


def test_the_stats_name_the_source_in_use_its_gain_and_why_each_other_is_off():
    """Issue 41 point 3: which source auto uses now, its measured gain, and why the others are off, in words."""
    from usd.events import Bound, Source, SourceState

    sources = (
        Source("tli", SourceState.CANNOT_PAY, 0.84),
        Source("slem", SourceState.DROPPED, 0.71),
        Source("ngram", SourceState.IN_USE, 1.42),
    )
    live = render.Live(Algorithm.AUTO)
    live.add(
        Round(7, 4, (piece("y", "accepted", 7),), 4, 4, 0.0, 0.1, 0.0, "ngram", expected_speedup=1.3, sources=sources)
    )
    text = render.stats_html(live.numbers(), Algorithm.AUTO)
    assert "ngram k=4 (n-gram lookup, no model), 1.42x plain decoding in this answer so far" in text
    assert "tli: cannot pay on this machine: at most 0.84x with every drafted token accepted" in text
    assert "slem: dropped for this answer: its rounds ran at 0.71x plain decoding" in text
    off = (
        Source("ngram", SourceState.NO_MATCH),
        Source("tli", SourceState.BUDGET),
        Source("slem", SourceState.LOSES, 0.8),
    )
    bound = Bound(1, 0.91, 0.26, 1.93, "while decoding")
    live.add(Round(8, 0, (piece("z", "target", 8),), 0, 0, 0.0, 0.1, 0.0, "none", bound=bound, sources=off))
    text = render.stats_html(live.numbers(), Algorithm.AUTO)
    assert "measured while decoding" in text and "ngram: the lookup finds no earlier text to copy here" in text
    assert "tli: trying it now could cost more than the answer&#x27;s probing budget has left" in text
    assert "slem: expected at 0.80x plain decoding; tried again now and then" in text


def test_a_plain_answer_shows_no_speedup_of_plain_against_plain_but_an_earlier_speculative_answer():
    plain = [plain_round(i) for i in range(3)]
    live = render.Live(Algorithm.NONE, baseline_tokens_per_s=10.0)
    for r in with_stats(plain):
        live.add(r)
    text = render.stats_html(live.numbers(), Algorithm.NONE)
    assert "measured speedup" not in text and "speedup" not in text and "tokens/s" in text
    live = render.Live(Algorithm.NONE, baseline_tokens_per_s=10.0, earlier_speculative=("auto", 20.0))
    for r in with_stats(plain):
        live.add(r)
    n = live.numbers()
    assert n["measured_speedup"] is None and n["earlier_speculative"]["ratio"] == pytest.approx(n["tokens_per_s"] / 20)
    text = render.stats_html(n, Algorithm.NONE)
    assert "an earlier speculative answer (auto)" in text and "20.0 tokens/s" in text and "of it" in text


def test_when_nothing_can_pay_the_stats_say_so_from_the_first_round_with_the_bound():
    from usd.events import Bound

    first = Round(0, 0, (piece("x", "target", 0),), 0, 0, 0.0, 0.1, 0.0, "none", bound=Bound(2, 0.97, 0.28, 2.45))
    live = render.Live(Algorithm.AUTO)
    live.add(first)
    text = render.stats_html(live.numbers(), Algorithm.AUTO)
    assert "plain decoding: the drafter model cannot pay on this machine" in text
    assert "0.97x" in text and "3 / (2·0.28 + 2.45)" in text and "c = 0.28" in text and "v(2) = 2.45" in text


def test_an_answer_that_drafted_nothing_is_not_warned_about_speculation():
    assert render.warning_text({"measured_speedup": 0.8, "acceptance_rate": None}, Algorithm.AUTO) is None


def auto_answer(speculative_rounds: int, c: float, v: float) -> dict:
    """An auto answer's numbers, 256 rounds of 0.06 s steps, measured at 0.94x an earlier plain answer."""
    return {
        "measured_speedup": 0.94,
        "acceptance_rate": 0.5,
        "rounds_by_algorithm": {"none": 256 - speculative_rounds, "tli": speculative_rounds},
        "c": c,
        "v": v,
        "mean_k": 1.0,
        "step_s": 0.06,
        "wall_s": 256 * 0.06 / 0.94,
    }


def test_a_few_probing_rounds_are_not_blamed_for_a_slower_answer():
    """Seen in the Chat tab: auto probed in a handful of its 256 rounds and ran at 0.94x an earlier plain answer; its
    rounds cannot have cost 6%, so the panel shows the number and no warning that blames speculation."""
    assert render.speculation_cost_share(auto_answer(4, 0.2, 1.6)) < 1 - render.SLOWER
    assert render.warning_text(auto_answer(4, 0.2, 1.6), Algorithm.AUTO) is None
    assert "slowing this pair down" in render.warning_text(auto_answer(120, 0.2, 1.6), Algorithm.AUTO)


def test_the_warning_names_the_cost_its_numbers_show():
    """A cheap drafter (c 0.03) with a costly verify is not "a drafter too slow for the target"."""
    verify = render.warning_text(auto_answer(120, 0.03, 1.6), Algorithm.AUTO)
    assert "checking the drafts costs the target" in verify and "1.60 target steps" in verify
    assert "drafter is too slow" not in verify
    drafter = render.warning_text(auto_answer(120, 0.9, 1.2), Algorithm.AUTO)
    assert "drafter is too slow" in drafter and "0.90 of a target step" in drafter


def test_the_chart_legend_says_what_its_lines_are():
    from app.views import live_view

    view = live_view("live", ("tokens", "stats", "chart"))
    assert "drafted tokens accepted" in view.html_template and "tokens emitted" in view.html_template


def test_the_live_view_is_sent_its_new_chart_rows_and_every_row_at_the_end():
    from app.views import ChatViews

    views, live = ChatViews([]), render.Live(Algorithm.TLI)
    spec = with_stats([spec_round(i, ["a"], [], "b", "bonus") for i in range(3)])
    sent = []
    for r in spec:
        live.add(r)
        sent.append(views.update(live)[1]["chart"])
    assert [(c["from"], len(c["rows"])) for c in sent] == [(0, 1), (1, 1), (2, 1)]
    live.add(Finished("ababab", (1, 1, 1, 1, 1, 1), live.stats))
    last = views.update(live)[1]
    assert last["chart"] == {"from": 0, "rows": live.chart} and last["tokens"]["from"] == 0
    assert last["stats"] == render.stats_html(live.numbers(), Algorithm.TLI)


def test_the_chat_streams_two_outputs_and_the_message_box_is_not_one_of_them():
    """Each output of the streaming event costs the page work at every update (Gradio's bookkeeping per output): the
    chat streams into the chat and one live view, and the box is emptied by an event of its own before it."""
    import gradio as gr

    from app.chat_tab import chat_tab

    with gr.Blocks():
        chat = chat_tab()
    assert chat.outputs == [chat.chatbot, chat.live]
    assert chat.box not in chat.outputs


def test_a_chat_that_is_not_due_puts_nothing_on_the_wire():
    """Through Gradio's own postprocessing and stream diff, as the chat's event sends them: between its due times the
    chat sends nothing (no whole value, no property update), the live view only what is new, and the chat's next due
    update is an append to the answer, not the whole chat again."""
    import asyncio

    import gradio as gr
    from gradio.state_holder import SessionState

    from app.chat_tab import chat_tab
    from app.views import ChatViews

    with gr.Blocks() as demo:
        chat = chat_tab()
        gr.Button().click(lambda: None, None, chat.outputs)
    fn, state = demo.fns[max(demo.fns)], SessionState(demo)

    async def on_the_wire(update):
        data = await demo.postprocess_data(fn, list(update), state)
        return demo.handle_streaming_diffs(fn, data, "session", "run", final=False)

    views, live = ChatViews([{"role": "user", "content": "hi"}]), render.Live(Algorithm.TLI)
    rounds = with_stats([spec_round(i, ["a"], [], "b", "bonus") for i in range(4)])
    sent = []
    for r in rounds[:-1]:
        live.add(r)
        sent.append(asyncio.run(on_the_wire(views.update(live))))
    for wire in sent[1:]:  # within the chat's interval of the first update
        assert wire[0] == [], wire
        replaced = [path for op, path, _ in wire[1] if op in ("add", "replace")]
        assert ["tokens", "html"] in replaced, wire
        # the chart's one new row (whatever Gradio's diff makes of it), never the rows sent before
        assert all(path[2] == 0 for path in replaced if path[:2] == ["chart", "rows"]), wire
    live.add(rounds[-1])
    live.add(Finished("abababab", tuple(range(8)), live.stats))
    chat_edits = asyncio.run(on_the_wire(views.update(live)))[0]
    assert chat_edits and all(op == "append" for op, *_ in chat_edits), chat_edits


def test_the_token_view_is_sent_only_its_new_pieces_and_the_whole_answer_at_the_end():
    feed, pieces = render.TokenFeed(), [piece("a", "target", 0)]
    first = feed.update(pieces)
    pieces += [piece("b", "accepted", 1), piece("c", "rejected", 1)]
    second = feed.update(pieces)
    assert (first["from"], first["to"], second["from"], second["to"]) == (0, 1, 1, 3)
    assert ">a<" in first["html"] and ">a<" not in second["html"]
    assert ">b<" in second["html"] and "<s " in second["html"]
    assert first["run"] == second["run"] != render.TokenFeed().update([])["run"]
    last = feed.update(pieces, whole=True)
    assert (last["from"], last["to"]) == (0, 3) and last["html"] == render.pieces_spans(pieces)


def test_background_stream_merges_the_rounds_between_updates():
    import threading

    from app.views import in_background

    def rounds():
        for i in range(40):
            time.sleep(0.005)
            yield i

    started = time.monotonic()
    batches = list(in_background(rounds, threading.Event(), interval=0.1))
    took = time.monotonic() - started
    assert [x for b in batches for x in b] == list(range(40))
    assert batches[0] == [0], "the first round goes out at once"
    assert len(batches) <= took / 0.1 + 2, f"{len(batches)} updates in {took:.2f} s"


def test_an_engine_bug_reaches_the_ui_as_a_request_for_a_report_not_as_bad_input():
    import gradio as gr

    from app.handlers import shown_to_user
    from usd.errors import InternalError

    def broken():
        raise InternalError("candidate 0 (id 7) has q = 0")

    def bad_input():
        raise ValueError("temperature must be a number from 0 (greedy) to 5")

    with pytest.raises(gr.Error) as bug:
        shown_to_user(broken)()
    assert bug.value.message == "Internal error, please report it: candidate 0 (id 7) has q = 0"
    assert bug.value.print_exception  # a bug: its traceback goes to the log
    with pytest.raises(gr.Error) as mistake:
        shown_to_user(bad_input)()
    assert mistake.value.message.startswith("temperature must be") and not mistake.value.print_exception


def test_views_update_less_often_where_the_engine_has_a_thread_on_every_core(monkeypatch):
    """Where the target computes on this machine's CPU with a thread on every core, each update of the page displaces
    one of them (the step then waits at its barrier): the views keep the BUSY_CORES pace there, over the app's channel
    or through Gradio."""
    from types import SimpleNamespace

    from app import views
    from usd import pair

    monkeypatch.setattr(pair, "cpu_threads", lambda: 4)

    def on(threads):
        """A pair whose target's runner computes on `threads` of this CPU's (None: elsewhere)."""
        p = pair.Pair.__new__(pair.Pair)
        p.target_runner = SimpleNamespace(cpu_threads=lambda: threads)
        return p

    for channel, calm, busy in (
        (True, views.PACE, views.BUSY_CORES_PACE),
        (False, views.GRADIO_PACE, views.BUSY_CORES_GRADIO_PACE),
    ):
        assert busy.live > calm.live and busy.chat >= calm.chat
        assert views.pace(on(4), channel) == busy  # on every core
        assert views.pace(on(2), channel) == calm  # cores to spare for the page
        assert views.pace(on(None), channel) == calm  # a GPU
    assert views.BUSY_CORES_PACE.live < 1.0, "the token view updates a few times a second even there"


def test_runners_say_which_threads_of_this_cpu_they_compute_on(monkeypatch):
    """What the pace above reads: the transformers runner computes on torch's threads on the CPU, and elsewhere on
    none of this CPU's; a remote server's model on none."""
    from types import SimpleNamespace

    import torch

    from app.remote import RemoteModel
    from usd.runners import Runner
    from usd.runners.transformers import TransformersRunner

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    on_cpu, on_gpu = (TransformersRunner(SimpleNamespace(device=torch.device(d))) for d in ("cpu", "cuda"))
    assert isinstance(on_cpu, Runner) and on_cpu.cpu_threads() == 3
    assert on_gpu.cpu_threads() is None
    assert not RemoteModel(client=None, model="m", drafter=None, usd=True).fills_cpu()
