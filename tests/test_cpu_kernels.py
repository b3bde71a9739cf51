"""The CPU kernel choice (usd/runners/transformers/cpu_kernels.py): measured once per model and machine and cached,
unless the machine was busy while it measured; either way the model runs on the backend chosen, with the same greedy
answer."""

from __future__ import annotations

import json

import pytest
import torch

from usd.runners.transformers import cpu_kernels


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def timings(monkeypatch):
    """measure() with made-up timings, counting its calls."""
    calls = []

    def measure(model):
        calls.append(model)
        return {"default": 2.0, "onednn": 1.0}

    monkeypatch.setattr(cpu_kernels, "measure", measure)
    return calls


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_choice_is_measured_once_then_read_from_the_cache(tmp_path, timings, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "busy", lambda: False)
    model = Tiny()
    x = torch.randn(3, 16)
    before = model(x)
    assert cpu_kernels.choose_linear_backend(model, "tiny", tmp_path, log=lambda m: None) == "onednn"
    assert cpu_kernels.backend_of(model) == "onednn" and torch.allclose(model(x), before, atol=1e-5)
    again = Tiny()
    assert cpu_kernels.choose_linear_backend(again, "tiny", tmp_path, log=lambda m: None) == "onednn"
    assert len(timings) == 1, "the second load reads the cached choice"
    cached = json.loads((tmp_path / cpu_kernels.CACHE_FILE).read_text())
    assert [v["backend"] for k, v in cached.items() if k.endswith("|tiny")] == ["onednn"]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_choice_measured_on_a_busy_machine_is_used_but_not_cached(tmp_path, timings, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "busy", lambda: True)
    said = []
    assert cpu_kernels.choose_linear_backend(Tiny(), "tiny", tmp_path, log=said.append) == "onednn"
    assert not (tmp_path / cpu_kernels.CACHE_FILE).exists() and any("busy" in m for m in said)
    cpu_kernels.choose_linear_backend(Tiny(), "tiny", tmp_path, log=said.append)
    assert len(timings) == 2, "measured again at the next load"


def test_busy_reads_the_load_per_core(monkeypatch):
    monkeypatch.setattr(cpu_kernels.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_kernels.os, "getloadavg", lambda: (6.0, 5.0, 4.0))
    assert cpu_kernels.busy()
    monkeypatch.setattr(cpu_kernels.os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert not cpu_kernels.busy()
