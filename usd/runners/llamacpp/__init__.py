"""The llama.cpp runner (precision gguf): a GGUF as it is, on llama.cpp's CPU kernels, lossless by the rule in
`kernels.py`. `binding` loads the library, `model` the GGUF, `pool` and `cache` hold its llama.cpp contexts, `twin`
reads its prompts on AMX tiles where the CPU has them, `context` is the decoding context the loop drives, `checks`
compares the runner with llama.cpp's own generate."""

from .binding import BUILD_ARGS, EXACT_ROWS, INSTALL_HINT, LlamaCppUnavailable, amx_prefill, available, exact_rows
from .checks import batch_invariance, llama_with_our_attention
from .kernels import GEMM_ROWS, N_BATCH, PREFILL, PREFILL_MIN_ROWS, ROW, TAIL, Batching, Kernel
from .model import N_CTX_CAP, LlamaCppModel, row_gaps
from .pool import MAX_CACHES

__all__ = [
    "BUILD_ARGS",
    "EXACT_ROWS",
    "GEMM_ROWS",
    "INSTALL_HINT",
    "MAX_CACHES",
    "N_BATCH",
    "N_CTX_CAP",
    "PREFILL",
    "PREFILL_MIN_ROWS",
    "ROW",
    "TAIL",
    "Batching",
    "Kernel",
    "LlamaCppModel",
    "LlamaCppUnavailable",
    "amx_prefill",
    "available",
    "batch_invariance",
    "exact_rows",
    "llama_with_our_attention",
    "row_gaps",
]
