"""The transformers runner: PyTorch models with a transformers KV cache per decoding context (`context.py`); on a
GPU a static cache or a compiled step (`static_cache.py`, chosen by `steps.py`), on a CPU the Linear layers' backend
(`cpu_kernels.py`), each chosen by a timing at load; recurrent layers snapshot and stepped (`recurrent.py`)."""

from .context import Context
from .runner import TransformersRunner

__all__ = ["Context", "TransformersRunner"]
