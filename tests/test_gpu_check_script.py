"""The GPU check script runs the same loading path on a CPU (the GPU run is done by hand where a GPU is lent)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from usd.loading import choose_precision, entry_for

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_quantized.py"


def test_gpu_check_script_runs_on_cpu():
    spec = importlib.util.spec_from_file_location("gpu_check_quantized", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.run("cpu", ["fp32", "bf16"])
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    assert all(r["new_tokens"] == 16 for r in rows)
    assert all(r["decoding_steps"] == "dynamic" and r["loop_s"]["standard"] > 0 for r in rows)  # CPU: no step choice
    assert rows[0]["standard_equals_plain"], rows[0].get("first_difference")
    assert rows[0]["loaded_as"] == "fp32" and rows[0]["linear_weight_dtype"] == "torch.float32"
    # bf16 where the loader finds native bf16 on this CPU, else its documented float32 fallback: ask the loader
    # itself, so the test holds on an AVX512-BF16/AMX Xeon and on an AVX2-only EPYC alike.
    expected, why = choose_precision(entry_for(SCRIPT.parent.as_posix()), "cpu", "bf16")
    assert rows[1]["loaded_as"] == expected and rows[1]["why"] == why
    if expected == "bf16":
        assert rows[1]["linear_weight_dtype"] == "torch.bfloat16"
        assert rows[1]["weights_bytes"] < rows[0]["weights_bytes"]
    else:
        assert "no native bf16" in why
        assert rows[1]["linear_weight_dtype"] == "torch.float32"
        assert rows[1]["weights_bytes"] == rows[0]["weights_bytes"]
