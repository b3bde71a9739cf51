"""The `usd` command line: models, pull, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from usd.cli import main


@pytest.mark.real_models
def test_models_json_lists_every_entry_with_readiness(catalog, real_paths, capsys):
    assert main(["models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["models"]}
    assert set(rows) == set(catalog.names())
    for name, path in real_paths.items():
        assert rows[name]["ready"] is True and rows[name]["path"] == str(path)
    assert rows["llama-3.1-70b-instruct"]["ready"] is False  # a hub model that is not here
    assert rows["qwen2.5-coder-0.5b-instruct"]["default"] and rows["smollm2-135m-instruct"]["default"]
    assert data["default"] == {"target": "qwen2.5-coder-0.5b-instruct", "drafter": "smollm2-135m-instruct"}
    assert len(data["pairs"]) == len(catalog.pairs)


@pytest.mark.real_models
def test_models_table(real_paths, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct" in out and "(default)" in out and "Suggested pairs" in out


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
