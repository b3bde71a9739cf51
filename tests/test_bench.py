"""`usd bench` on the real pair: 2 prompts, 8 tokens, every algorithm; JSON, CSV and PNG; a draft-length sweep."""

from __future__ import annotations

import csv
import json

import pytest

from usd.algorithms import Algorithm
from usd.bench.run import ALGORITHMS, SUMMARY_KEYS, bench
from usd.cli import main
from usd.datasets import Prompt
from usd.pair import Pair
from usd.runners import llamacpp
from usd.sampling import SamplingParams

pytestmark = pytest.mark.real_models
PROMPTS = [{"prompt": "def is_even(n):"}, {"messages": [{"role": "user", "content": "Name three colours."}]}]
SMALL_PAIR = ["--target", "qwen2.5-coder-0.5b-instruct", "--drafter", "smollm2-135m-instruct"]


def valid_png(path) -> tuple[int, ...]:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path).shape


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def test_bench_every_algorithm_json_csv_png(tmp_path, prompts_file, real_paths, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            *SMALL_PAIR,
            "--dataset",
            str(prompts_file),
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--precision",
            "fp32",
            "--algorithms",
            ",".join(a for a in ALGORITHMS if a != "llamacpp"),
            "--draft-tokens",
            "4",
            "--json",
            f"{out}.json",
            "--csv",
            f"{out}.csv",
            "--plot",
            f"{out}.png",
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result) >= {"summary", "prompts", "machine", "settings"}
    rows = {r["algorithm"]: r for r in result["summary"]}
    # standard needs one tokenizer for both models: dropped for this pair (it runs in the next test)
    assert set(rows) == {"none", "tli", "slem", "ngram", "suffix", "auto", "hf"}
    for r in rows.values():
        assert set(SUMMARY_KEYS) <= set(r)
        assert r["identical_to_none"] is True, f"{r['algorithm']} differs from plain greedy"
        assert r["wall_s"] > 0 and r["tokens_per_s"] > 0 and r["speedup_vs_none"] > 0 and r["speedup_vs_hf"] > 0
    for a in ("tli", "slem"):
        assert 0 <= rows[a]["acceptance_rate"] <= 1 and rows[a]["tokens_per_round"] >= 1
        assert rows[a]["c"] > 0 and rows[a]["v"] > 0 and rows[a]["mean_k"] > 0 and 0 <= rows[a]["overhead_share"] < 1
        assert rows[a]["predicted_speedup"] > 0
    assert rows["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert rows["hf"]["acceptance_rate"] is None and rows["none"]["acceptance_rate"] is None
    assert rows["hf"]["predicted_speedup"] is None and rows["none"]["predicted_speedup"] is None
    assert len(result["prompts"]) == 2 * len(rows)  # every prompt under every algorithm
    assert result["machine"]["target"] == "qwen2.5-coder-0.5b-instruct"
    with open(tmp_path / "out.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["algorithm"] for r in table] == [r["algorithm"] for r in result["summary"]]
    assert set(table[0]) == set(SUMMARY_KEYS)
    assert valid_png(tmp_path / "out.png")[0] > 100
    assert "| tli k=4 |" in capsys.readouterr().out


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")
def test_bench_llamacpp_reference_row(tmp_path, prompts_file, real_paths, capsys):
    """On the llama.cpp runner, the reference row is llama-cpp-python's own generate of the target's GGUF: the same
    fields as ours, and (greedy) the same tokens as our plain decoding."""
    rc = main(
        [
            "bench",
            *SMALL_PAIR,
            "--dataset",
            str(prompts_file),
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
            "--precision",
            "gguf",
            "--algorithms",
            "none,tli,auto,llamacpp",
            "--json",
            str(tmp_path / "l.json"),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "l.json").read_text())
    rows = {r["algorithm"]: r for r in result["summary"]}
    assert set(rows) == {"none", "tli", "auto", "llamacpp"} and result["machine"]["dtype"] == "gguf"
    assert set(SUMMARY_KEYS) <= set(rows["llamacpp"])
    assert rows["llamacpp"]["acceptance_rate"] is None and rows["llamacpp"]["tokens_per_s"] > 0
    for r in rows.values():
        assert r["identical_to_none"] is True, f"{r['algorithm']} differs from our plain greedy"
        assert r["speedup_vs_llamacpp"] > 0
    assert "vs llama.cpp" in capsys.readouterr().out


def test_bench_llamacpp_reference_needs_the_gguf_target(prompts_file, real_paths, capsys):
    rc = main(
        ["bench", *SMALL_PAIR, "--dataset", str(prompts_file), "--precision", "fp32", "--algorithms", "none,llamacpp"]
    )
    assert rc == 2 and "--precision gguf" in capsys.readouterr().err


def test_bench_standard_on_a_same_tokenizer_pair(catalog, real_paths):
    from usd.loading import load_model

    t = load_model(catalog.get("smollm2-135m-instruct"), device="cpu", precision="fp32", log=lambda m: None)
    pair = Pair(t.model, t.tokenizer, t.model, t.tokenizer, "smol", "smol", context_length=8192)
    prompts = [Prompt(f"p{i}", p.get("prompt"), p.get("messages")) for i, p in enumerate(PROMPTS)]
    result = bench(
        pair, prompts, [Algorithm.NONE, Algorithm.STANDARD, "hf"], 3, SamplingParams(), 8, log=lambda m: None
    )
    rows = {r["algorithm"]: r for r in result["summary"]}
    assert rows["standard"]["identical_to_none"] and rows["hf"]["identical_to_none"]
    assert rows["standard"]["acceptance_rate"] == 1.0, "the target drafting for itself is always right"


def test_bench_sweep_over_draft_lengths(tmp_path, prompts_file, real_paths):
    rc = main(
        [
            "bench",
            *SMALL_PAIR,
            "--dataset",
            str(prompts_file),
            "--limit",
            "1",
            "--max-new-tokens",
            "6",
            "--precision",
            "fp32",
            "--algorithms",
            "none,slem",
            "--draft-tokens",
            "sweep",
            "--json",
            str(tmp_path / "s.json"),
            "--plot",
            str(tmp_path / "s.png"),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "s.json").read_text())
    ks = [r["k"] for r in result["summary"] if r["algorithm"] == "slem"]
    assert ks == list(range(1, 9))
    assert all(r["identical_to_none"] for r in result["summary"])
    height, width, _ = valid_png(tmp_path / "s.png")
    assert width > 2 * height, "three panels side by side"
    from usd.bench.plots import main as replot

    assert replot([str(tmp_path / "s.json"), str(tmp_path / "again.png")]) == 0
    assert valid_png(tmp_path / "again.png") == (height, width, 4)


def test_bench_suggested_pairs_that_are_on_this_machine(tmp_path, prompts_file, real_paths, catalog):
    rc = main(
        [
            "bench",
            "--pairs",
            "suggested",
            "--dataset",
            str(prompts_file),
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
            "--algorithms",
            "none,tli",
            "--draft-tokens",
            "2",
            "--json",
            str(tmp_path / "p.json"),
            "--csv",
            str(tmp_path / "p.csv"),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert rc == 0
    ran = [
        (r["machine"]["target"], r["machine"]["drafter"])
        for r in json.loads((tmp_path / "p.json").read_text())["pairs"]
    ]
    # every suggested pair whose two models ship on the registry (the tests pulled them); hub-only pairs are skipped
    offline = {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"}
    assert ran == [(p.target, p.drafter) for p in catalog.pairs if {p.target, p.drafter} <= offline]
    with open(tmp_path / "p.csv") as f:
        assert {(r["target"], r["drafter"]) for r in csv.DictReader(f)} == set(ran)
    for target, drafter in ran:
        valid_png(tmp_path / f"p-{target}+{drafter}.png")
    from usd.bench.plots import main as replot

    assert replot([str(tmp_path / "p.json"), str(tmp_path / "again.png")]) == 0  # redrawn under the same names
    for target, drafter in ran:
        valid_png(tmp_path / f"again-{target}+{drafter}.png")
