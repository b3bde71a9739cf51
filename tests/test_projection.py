"""`usd project`: the theory against hand-computed values, profiles, alpha from a bench result, and the profiling
script on tiny configs (the CPU stand-in for the GPU run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from usd.bench.projection import alphas_from_bench, costs, project
from usd.cli import main
from usd.theory import tau

ROOT = Path(__file__).resolve().parent.parent
PROFILE = {
    "device": "test GPU",
    "models": {
        "big@nf4": {"step_s": 0.020, "verify_s": {"1": 0.022, "2": 0.024, "3": 0.030}},
        "big@bf16": {"step_s": 0.030, "verify_s": {"1": 0.031}},
        "small@bf16": {"step_s": 0.002, "verify_s": {"1": 0.002}},
    },
}


def test_projection_matches_hand_computed_values():
    # alpha 0.5, k 2: tau = (1 - 0.5^3) / (1 - 0.5) = 1.75; S = 1.75 / (2 * 0.1 + 1.2) = 1.25
    rows = project(0.5, 0.1, {1: 1.1, 2: 1.2}, k_max=2)
    assert [r["k"] for r in rows] == [1, 2]
    assert rows[0]["tau"] == pytest.approx(1.5) and rows[0]["speedup"] == pytest.approx(1.5 / 1.2)
    assert rows[1]["tau"] == pytest.approx(1.75) and rows[1]["speedup"] == pytest.approx(1.25)
    # alpha 1: every draft kept, tau = k + 1; one number for v applies to every k
    assert project(1.0, 0.0, 1.0, k_max=3)[-1]["speedup"] == pytest.approx(4.0)
    # alpha 0: one token per round, every draft is pure cost
    assert project(0.0, 0.25, 1.0, k_max=2)[-1]["speedup"] == pytest.approx(1 / 1.5)
    with pytest.raises(ValueError, match="alpha must be between 0 and 1"):
        project(1.5, 0.1, 1.0)


def test_costs_from_a_profile():
    c, v = costs(PROFILE, "big@nf4", "small")
    assert c == pytest.approx(0.1)
    assert v == {1: pytest.approx(1.1), 2: pytest.approx(1.2), 3: pytest.approx(1.5)}
    with pytest.raises(ValueError, match="several precisions"):
        costs(PROFILE, "big", "small")
    with pytest.raises(ValueError, match="huge not in the profile"):
        costs(PROFILE, "huge", "small")


def test_alpha_per_algorithm_from_a_bench_result():
    result = {
        "summary": [
            {"algorithm": "none", "k": 0, "acceptance_rate": 0.0},
            {"algorithm": "tli", "k": 1, "acceptance_rate": 0.4},
            {"algorithm": "tli", "k": 2, "acceptance_rate": 0.6},
            {"algorithm": "slem", "k": "auto", "acceptance_rate": 0.7},
            {"algorithm": "auto", "k": "auto", "acceptance_rate": 0.3},
            {"algorithm": "hf", "k": None, "acceptance_rate": None},
        ]
    }
    assert alphas_from_bench(result) == {"tli": pytest.approx(0.5), "slem": pytest.approx(0.7)}
    assert alphas_from_bench({"pairs": [result]}) == alphas_from_bench(result)


def test_project_command(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(PROFILE))
    assert (
        main(
            [
                "project",
                "--target-config",
                "big@nf4",
                "--drafter-config",
                "small",
                "--alpha",
                "0.5",
                "--profile",
                str(profile),
                "--k-max",
                "3",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["c"] == pytest.approx(0.1)
    assert [r["speedup"] for r in out["projections"]["given"]] == pytest.approx([1.5 / 1.2, 1.25, 1.875 / 1.8])
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"summary": [{"algorithm": "slem", "k": 4, "acceptance_rate": 0.5}]}))
    assert (
        main(
            [
                "project",
                "--target-config",
                "big@nf4",
                "--drafter-config",
                "small",
                "--from-bench",
                str(bench),
                "--profile",
                str(profile),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "slem: alpha = 0.50; best k = 1, expected speedup 1.25x" in text  # k = 1 and 2 tie at 1.25; the shorter wins
    assert (
        main(
            [
                "project",
                "--target-config",
                "big@nf4",
                "--drafter-config",
                "nope",
                "--alpha",
                "0.5",
                "--profile",
                str(profile),
            ]
        )
        == 2
    )
    assert "nope not in the profile" in capsys.readouterr().err


def test_profile_script_on_tiny_configs(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_profile.py"),
            "--tiny",
            "--device",
            "cpu",
            "--model",
            "llama-3.1-8b@fp32",
            "--model",
            "smollm2-135m",
            "--context",
            "16",
            "--k-max",
            "3",
            "--reps",
            "2",
            "--steps",
            "dynamic,static",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    profile = json.loads(out.read_text())
    assert profile["tiny"] is True and set(profile["models"]) == {
        f"{name}@fp32{kind}" for name in ("llama-3.1-8b", "smollm2-135m") for kind in ("", "#static")
    }
    for m in profile["models"].values():
        assert m["step_s"] > 0 and set(m["verify_s"]) == {"1", "2", "3"} and all(s > 0 for s in m["verify_s"].values())
    for kind in ("", "#static"):
        c, v = costs(profile, f"llama-3.1-8b@fp32{kind}", f"smollm2-135m@fp32{kind}")
        assert c > 0 and set(v) == {1, 2, 3}


def test_project_what_if_without_a_profile(capsys):
    assert main(["project", "--alpha", "0.5", "--c", "0.1", "--v", "1.2", "--k-max", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["projections"]["given"][1]["speedup"] == pytest.approx(1.25)
    assert main(["project", "--alpha", "0.5", "--c", "0.1"]) == 2
    assert "--c and --v go together" in capsys.readouterr().err
    assert main(["project", "--alpha", "0.5", "--target-config", "x"]) == 2
    assert "--drafter-config" in capsys.readouterr().err


def test_the_lookup_is_projected_at_c_0_with_no_drafter_in_the_profile(tmp_path, capsys):
    """ngram runs no model: its projection is tau(alpha, k) / v(k), from the target's verify alone."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(PROFILE))
    args = ["project", "--target-config", "big@nf4", "--profile", str(profile), "--k-max", "3"]
    assert main([*args, "--alpha", "0.9", "--ngram", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["c"] is None
    expected = [tau(0.9, k) / v for k, v in ((1, 1.1), (2, 1.2), (3, 1.5))]
    assert [r["speedup"] for r in out["projections"]["ngram"]] == pytest.approx(expected)
    bench = tmp_path / "bench.json"
    rows = [
        {"algorithm": "ngram", "k": 4, "acceptance_rate": 0.9},
        {"algorithm": "tli", "k": 4, "acceptance_rate": 0.5},
    ]
    bench.write_text(json.dumps({"summary": rows}))
    assert main([*args, "--drafter-config", "small", "--from-bench", str(bench)]) == 0
    text = capsys.readouterr().out
    assert f"ngram (a lookup: c = 0): alpha = 0.90; best k = 3, expected speedup {max(expected):.2f}x" in text
    assert main([*args, "--from-bench", str(bench)]) == 2  # tli's alpha needs the drafter's c
    assert "--drafter-config" in capsys.readouterr().err
