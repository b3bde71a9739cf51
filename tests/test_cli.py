"""The `usd` command line: models, pull, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from usd import store
from usd.cli import main


@pytest.fixture(autouse=True)
def scratch_cache(request, monkeypatch, tmp_path_factory):
    """Loading a local directory takes a lock in the cache: keep the tests' out of the user's, which the tests on
    the real models read."""
    if "real_paths" not in request.fixturenames:
        monkeypatch.setenv(store.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))


@pytest.mark.real_models
def test_models_json_lists_every_entry_with_readiness(catalog, real_paths, capsys):
    assert main(["models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["models"]}
    assert set(rows) == set(catalog.names())
    for name, path in real_paths.items():
        assert rows[name]["ready"] is True and rows[name]["path"] == str(path)
    assert rows["llama-3.1-70b-instruct"]["ready"] is False  # a hub model that is not here
    assert rows["qwen2.5-coder-1.5b-instruct"]["default"] and rows["smollm2-135m-instruct"]["default"]
    assert data["default"] == {"target": "qwen2.5-coder-1.5b-instruct", "drafter": "smollm2-135m-instruct"}
    assert len(data["pairs"]) == len(catalog.pairs)


@pytest.mark.real_models
def test_models_table(real_paths, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in out and "(default)" in out and "Suggested pairs" in out


@pytest.mark.real_models
def test_pull_is_idempotent_through_the_cli(real_paths, capsys):
    assert main(["pull", "smollm2-135m-instruct", "gemma-3-270m"]) == 0
    out = capsys.readouterr().out
    assert f"smollm2-135m-instruct: ready at {real_paths['smollm2-135m-instruct']}" in out
    assert "gemma-3-270m: ready at" in out


def test_unknown_model_is_a_clear_error_not_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "usd", "pull", "no such model"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "not a catalog model, an existing path, or a hub repo id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_broken_user_catalog_is_reported(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("models:\n  - name: x\n    family: y\n")
    proc = subprocess.run([sys.executable, "-m", "usd", "--catalog", str(f), "models"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert str(f) in proc.stderr and "entry models[0] ('x')" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------------------------------
# `usd generate` with a local model directory that cannot be loaded: which directory, which file, what to do


def _tiny_llama_config(d, **extra):
    config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **extra,
    }
    (d / "config.json").write_text(json.dumps(config))


def _generate_err(capsys, target, *extra) -> str:
    assert main(["generate", "--target", str(target), "--algorithm", "none", "--prompt", "hi", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_local_dir_without_config_says_what_a_model_directory_needs(tmp_path, capsys, extra):
    err = _generate_err(capsys, tmp_path, *extra)
    assert f"{tmp_path} has no config.json" in err and "give a directory with config.json" in err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_local_dir_with_broken_config_names_the_file_and_line(tmp_path, capsys, extra):
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n}')
    err = _generate_err(capsys, tmp_path, *extra)
    assert f"{tmp_path / 'config.json'} is not valid JSON: line 2 column 1: " in err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_local_dir_without_weights_says_so_before_loading(tmp_path, capsys, extra):
    _tiny_llama_config(tmp_path)
    err = _generate_err(capsys, tmp_path, *extra)
    assert f"{tmp_path} has config.json but no weights (*.safetensors / pytorch_model*.bin)" in err


def test_local_dir_without_tokenizer_names_the_directory(tmp_path, capsys):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _tiny_llama_config(tmp_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).save_pretrained(tmp_path)
    err = _generate_err(capsys, tmp_path, "--device", "cpu", "--precision", "fp32")
    assert f"{tmp_path} has no usable tokenizer" in err and "tokenizer.json" in err


def test_broken_local_dir_is_reported_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text("{")
    proc = subprocess.run(
        [sys.executable, "-m", "usd", "generate", "--target", str(tmp_path), "--prompt", "hi", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{tmp_path / 'config.json'} is not valid JSON" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------------
# `usd generate` settings: the app's ranges, and every input error exits 2 with what to change


@pytest.fixture
def fake_load(monkeypatch):
    """load_pair without models: records its calls; a test that gets past it has nothing else to run on."""
    import usd.api

    calls = []
    monkeypatch.setattr(usd.api, "load_pair", lambda *a, **kw: calls.append((a, kw)) or object())
    return calls


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_samples_must_be_at_least_one(fake_load, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "hi", "--samples", value])
    assert exit_.value.code == 2 and not fake_load
    assert f"--samples: must be a whole number >= 1, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("17", "17"), ("64", "64"), ("x", "'x'")])
def test_draft_tokens_are_auto_or_one_to_sixteen_like_the_app(fake_load, capsys, value, shown):
    assert _exit_code(["generate", "--prompt", "hi", "--draft-tokens", value]) == 2
    assert not fake_load
    err = capsys.readouterr().err
    assert f"usd generate: draft tokens must be auto or a whole number from 1 to 16, got {shown}" in err
    assert "to decode without a drafter, use algorithm none" in err


def test_bad_messages_json_exits_2_naming_the_file(fake_load, capsys, tmp_path):
    f = tmp_path / "conversation.json"
    f.write_text('[{"role": "user", "content": "hi"},]', encoding="utf-8")
    assert main(["generate", "--messages-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f} is not valid JSON: line 1 column 36: " in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------------------
# `usd generate` checks every setting and input before loading (which takes seconds to minutes)


@pytest.fixture
def no_loading(monkeypatch):
    import usd.api

    def load_pair(*args, **kwargs):
        raise AssertionError("loaded models")

    monkeypatch.setattr(usd.api, "load_pair", load_pair)


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own checks
        return e.code


def _word_tokenizer_model(d, words):
    """A model directory with a word-level tokenizer; the weights file is a stand-in, loading is patched out."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)
    _tiny_llama_config(d)
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "usd generate: temperature must be a number from 0 (greedy) to 5, got -1.0"),
        (["--temperature", "nan"], "usd generate: temperature must be a number from 0 (greedy) to 5, got 'nan'"),
        (["--top-p", "0"], "usd generate: top-p must be a number above 0 and at most 1, got 0.0"),
        (["--top-p", "inf"], "usd generate: top-p must be a number above 0 and at most 1, got 'inf'"),
        (["--top-k", "-1"], "usd generate: top-k must be a whole number from 0 to 1,048,576, got -1"),
        (["--seed", "-1"], f"usd generate: seed must be a whole number from 0 to {(1 << 63) - 1:,}, got -1"),
        (["--max-new-tokens", "0"], "usd generate: max new tokens must be a whole number from 1 to 4,096, got 0"),
        (
            ["--algorithm", "fast"],
            "usd generate: unknown algorithm 'fast'; choose one of auto, tli, slem, standard, ngram, suffix, none",
        ),
        # found before loading now too (the decode loop used to find these after it)
        (["--max-new-tokens", "5000"], "usd generate: max new tokens must be a whole number from 1 to 4,096, got 5000"),
        (["--seed", str((1 << 63) - 2), "--samples", "3"], "seed must be a whole number from 0 to"),
    ],
)
def test_bad_settings_exit_2_before_loading(no_loading, capsys, args, message):
    assert _exit_code(["generate", "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_empty_prompt_exits_2_before_loading(no_loading, capsys):
    assert _exit_code(["generate", "--prompt", " ", "--chat"]) == 2
    assert "usd generate: the prompt is empty; type a question" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "content", "message"),
    [
        ("--prompt-file", b"caf\xe9", "{f} is not UTF-8 text (byte 3); save it as UTF-8"),
        ("--messages-file", b"[\xff]", "{f} is not UTF-8 text (byte 1); save it as UTF-8"),
        ("--prompt-file", b"\n", "{f}: the prompt is empty"),
        ("--messages-file", b'[{"role": "bot", "content": "hi"}]', "{f}: message 0 has role 'bot'; use one of"),
        ("--messages-file", b"{}", "{f}: messages must be a non-empty list"),
    ],
)
def test_bad_prompt_or_messages_file_exits_2_naming_it_before_loading(
    no_loading, capsys, tmp_path, option, content, message
):
    f = tmp_path / "input.txt"
    f.write_bytes(content)
    assert _exit_code(["generate", option, str(f)]) == 2
    assert message.format(f=f) in capsys.readouterr().err


def test_missing_messages_file_exits_2_before_loading(no_loading, capsys, tmp_path):
    f = tmp_path / "nowhere.json"
    assert _exit_code(["generate", "--messages-file", str(f)]) == 2
    assert f"cannot read the messages from {f}: No such file or directory" in capsys.readouterr().err


def test_a_broken_drafter_directory_is_found_before_the_target_loads(no_loading, capsys, tmp_path):
    assert _exit_code(["generate", "--drafter", str(tmp_path), "--prompt", "hi"]) == 2
    assert f"{tmp_path} has no config.json" in capsys.readouterr().err


def test_standard_with_different_tokenizers_exits_2_before_loading(no_loading, capsys, tmp_path):
    target = _word_tokenizer_model(tmp_path / "t", ["a", "b", "c"])
    drafter = _word_tokenizer_model(tmp_path / "d", ["a", "c", "b"])
    argv = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "a b", "--algorithm"]
    assert _exit_code([*argv, "standard"]) == 2
    assert "'standard' needs identical tokenizers" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded models"):  # the checks let a good pair through to loading
        _exit_code([*argv, "tli"])


def test_good_settings_reach_loading(no_loading):
    with pytest.raises(AssertionError, match="loaded models"):
        _exit_code(
            [
                "generate",
                "--prompt",
                "hi",
                "--temperature",
                "0.7",
                "--top-p",
                "0.9",
                "--top-k",
                "5",
                "--seed",
                "3",
                "--samples",
                "2",
                "--max-new-tokens",
                "4",
                "--draft-tokens",
                "3",
            ]
        )


needs_llamacpp = pytest.mark.skipif(
    not __import__("usd.runners.llamacpp").runners.llamacpp.available(),
    reason="the catalog's gguf defaults need llama-cpp-python",
)


@needs_llamacpp
def test_bench_refuses_hf_on_gguf_models_before_loading(no_loading, capsys):
    """Issue 27 point 9: the hf reference deep-copied a llama.cpp model and died with "cannot pickle 'module'
    object". transformers' assisted generation needs transformers models; the refusal says how to get them."""
    assert _exit_code(["bench", "--algorithms", "none,hf", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "needs transformers models, but " in err and " load as gguf on llama.cpp here" in err
    assert "add --precision fp32" in err


@needs_llamacpp
def test_bench_leaves_hf_out_of_its_default_algorithms_on_gguf_models(monkeypatch, tmp_path):
    import usd.api
    import usd.bench.run

    chosen = []

    def bench(pair, prompts, algorithms, *args, **kwargs):
        chosen.append(algorithms)
        raise ValueError("stop here")

    monkeypatch.setattr(usd.api, "load_pair", lambda *a, **k: None)
    monkeypatch.setattr(usd.bench.run, "bench", bench)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert _exit_code(["bench", "--dataset", str(prompts)]) == 2
    assert chosen == [["none", "tli", "slem", "auto"]]
    assert _exit_code(["bench", "--dataset", str(prompts), "--precision", "fp32"]) == 2
    assert chosen[-1] == ["none", "tli", "slem", "auto", "hf"]


def test_drafter_none_loads_the_target_alone(capsys):
    """`--drafter none` (usd generate, usd serve, the app): no drafter model; ngram and plain decoding need none."""
    from usd.catalog import drafter_arg

    assert drafter_arg("none") is False
    assert drafter_arg("smollm2-135m-instruct") == "smollm2-135m-instruct" and drafter_arg(None) is None
    assert _exit_code(["serve", "--help"]) == 0
    assert "'none': no drafter model" in " ".join(capsys.readouterr().out.split())
