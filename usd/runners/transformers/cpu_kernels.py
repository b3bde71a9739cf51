"""On a CPU, which fp32 matrix-multiply backend runs a model's Linear layers: PyTorch's default (MKL or OpenBLAS) or
oneDNN's. Decoding multiplies by a handful of rows at a time (one for a plain step, k + 1 for a verify), where the two
differ most and rank differently per machine (a 2-core AMD EPYC and an Intel Xeon of its size ranked them opposite ways;
docs/benchmarks.md has the runners' numbers). So it is measured, per model shape, at load time on the machine at hand,
and the choice is cached per machine (docs/design.md §7).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

import torch

ROWS = (1, 5)
"""The row counts timed: a plain step and a typical verify (k = 4)."""
REPEATS = 5
MARGIN = 0.9
"""oneDNN must be at least 10% faster in total to be used: the choice is made once, and noise should not flip it."""
CACHE_FILE = "cpu-kernels.json"
BUSY = 1.5
"""A choice measured while the 1-minute load average per core exceeds this (our own load counts up to 1) is used but
not cached: other work makes oneDNN's spinning threads wait their turn, which can time it many times slower than it
runs on a quiet machine, and a cached choice would keep that mistake."""


def cpu_name() -> str:
    """The CPU's model name where the OS gives one (hosts of one name differ in CPU from session to session)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    return f"{cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}"


class OneDNNLinear(torch.nn.Module):
    """A Linear layer whose weight is held in oneDNN's blocked layout and multiplied by oneDNN."""

    weight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    bias: torch.Tensor | None

    def __init__(self, dense: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.register_buffer("weight", dense.weight.detach().to_mkldnn())
        self.register_buffer("bias", dense.bias.detach().to_mkldnn() if dense.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()

    def __deepcopy__(self, memo) -> OneDNNLinear:
        return OneDNNLinear(self.to_dense())  # oneDNN's opaque tensors have no storage to copy

    def to_dense(self) -> torch.nn.Linear:
        dense = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        dense.weight = torch.nn.Parameter(self.weight.to_dense(), requires_grad=False)
        if self.bias is not None:
            dense.bias = torch.nn.Parameter(self.bias.to_dense(), requires_grad=False)
        return dense


def _linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [
        (name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
    ]


def _best_time(fn, x) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: other work on the machine only ever adds time


@torch.inference_mode()
def measure(model) -> dict:
    """Seconds per forward of every Linear, default and oneDNN, at the decoding row counts: one layer of each shape
    is timed (interleaved, the fastest of a few runs) and counted as often as the shape occurs."""
    counts: Counter = Counter()
    first: dict[tuple, torch.nn.Linear] = {}  # one layer of each shape, found in the same pass that counts them
    for _, m in _linears(model):
        shape = (m.in_features, m.out_features, m.bias is not None)
        counts[shape] += 1
        first.setdefault(shape, m)
    total = {"default": 0.0, "onednn": 0.0}
    for shape, layer in first.items():
        count = counts[shape]
        fast = OneDNNLinear(layer)
        for rows in ROWS:
            x = torch.randn(1, rows, layer.in_features)
            layer(x), fast(x)  # warm both
            total["default"] += count * _best_time(layer, x)
            total["onednn"] += count * _best_time(fast, x)
        del fast
    return total


def use_onednn(model) -> int:
    """Replace every fp32 Linear by oneDNN's; returns how many. Same weights, same sums up to rounding."""
    replaced = 0
    for name, layer in _linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, OneDNNLinear(layer))
        replaced += 1
    return replaced


def use_default(model) -> int:
    """Undo `use_onednn`: plain Linear layers with the same weights; returns how many."""
    replaced = 0
    for name, layer in list(model.named_modules()):
        if isinstance(layer, OneDNNLinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.to_dense())
            replaced += 1
    return replaced


def backend_of(model) -> str:
    return "onednn" if any(isinstance(m, OneDNNLinear) for m in model.modules()) else "default"


def choose_linear_backend(model, model_name: str, cache_dir: Path | None, log=print) -> str:
    """'onednn' or 'default' for this model on this machine: measured once, then read from the cache."""
    if not torch.backends.mkldnn.is_available() or not _linears(model):
        return "default"
    cache = cache_dir / CACHE_FILE if cache_dir is not None else None
    known = read_choices(cache)
    key = f"{machine_key()}|{model_name}"
    if key not in known:
        t = measure(model)
        choice = {"backend": "onednn" if t["onednn"] < MARGIN * t["default"] else "default", **t}
        if busy():
            log(
                f"{model_name}: the machine is busy, so this choice of Linear layers is not cached (it is measured "
                "again at the next load)"
            )
        else:
            known[key] = choice
            write_choices(cache, known)
    else:
        choice = known[key]
    log(
        f"{model_name}: fp32 Linear layers on {choice['backend']} (measured here: default "
        f"{choice['default'] * 1e3:.1f} ms, oneDNN {choice['onednn'] * 1e3:.1f} ms per 1- and 5-row pass)"
    )
    if choice["backend"] == "onednn":
        use_onednn(model)
    return choice["backend"]


def busy() -> bool:
    """Whether other work loads this machine's cores (where the load average is known)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        return False
    return load / max(1, os.cpu_count() or 1) > BUSY


def read_choices(path: Path | None) -> dict:
    try:
        data = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_choices(path: Path | None, data: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
