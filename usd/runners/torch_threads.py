"""How many threads torch computes with, following which runners hold the process's models.

A model on llama.cpp hands the decode loop its logits as torch tensors, and the loop's few operations over a whole
vocabulary (an argmax, a softmax) are large enough for torch to split them over all its threads. Torch's OpenMP
threads then keep spinning, waiting for more work, into the next llama.cpp step, whose own threads need the same
cores: on a 2-core CPU that made plain decoding measurably slower (docs/benchmarks.md, "llama.cpp on its own
threads"). So while no model of the process computes on torch, torch computes on one thread (such operations take
microseconds on one), and a model on torch gets torch's own thread count back.
"""

from __future__ import annotations

import threading
import weakref

import torch

_lock = threading.Lock()
_on_torch: weakref.WeakSet = weakref.WeakSet()
"""The loaded models that compute on torch (gone once nothing else holds them)."""
_default: list[int] = []
"""Torch's own thread count, read before the first change."""


def follow(model, on_torch: bool) -> None:
    """A model was loaded: torch's threads follow the models now held (`model` counts if it computes on torch)."""
    with _lock:
        if not _default:
            _default.append(torch.get_num_threads())
        if on_torch:
            _on_torch.add(model)
        torch.set_num_threads(_default[0] if len(_on_torch) else 1)
