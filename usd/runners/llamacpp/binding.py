"""llama-cpp-python's low-level API, loaded once: the library with its backend initialised and its log kept for our
error messages, and how to install it when it is missing."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from importlib.metadata import version

GGML_TYPE_F16, GGML_TYPE_BF16 = 1, 30  # ggml.h's enum ggml_type (the binding names no BF16)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that leave llama.cpp's AMX kernels out of a build for the builder's own CPU (see `_refuse_amx`)."""
BUILD_ARGS = (
    "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    f"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"
)
INSTALL_HINT = (
    "precision gguf runs the model's GGUF on llama.cpp, through llama-cpp-python, which is not installed. It builds "
    "llama.cpp from source (a few minutes, once): "
    f'CMAKE_ARGS="{BUILD_ARGS}" pip install "usd-chat[llamacpp]" '
    "(./dev.sh setup does this). Or choose --precision fp32 / bf16 to run the model on transformers."
)


class LlamaCppUnavailable(ImportError):
    """llama-cpp-python is not installed (or its library does not load); the message says how to install it."""


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


_lock = threading.Lock()
_state: dict = {}


def library():
    """llama_cpp, with the backend initialised and its log quieted (errors are kept for our messages)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        try:
            import llama_cpp
        except (ImportError, OSError) as e:
            raise LlamaCppUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
        errors: list[str] = []

        @llama_cpp.llama_log_callback
        def log(level, text, user_data):
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                errors.append(text.decode("utf-8", "replace").strip())
                del errors[:-5]

        _refuse_amx(llama_cpp.llama_print_system_info())
        llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _state.update(lib=llama_cpp, log=log, errors=errors)  # the callback must outlive every call into llama.cpp
        return llama_cpp


def _refuse_amx(system_info: bytes) -> None:
    """A build with llama.cpp's AMX kernels (what -march=native compiles where the CPU reports AMX) is refused before
    it runs: its AMX buffer takes the K-quant weights the runner's exactness rule is measured on (kernels.py), and on
    an AMX machine here its first tile-config load died with a general protection fault, which kills the process."""
    if b"AMX_INT8 = 1" in system_info:
        raise LlamaCppUnavailable(
            "this llama-cpp-python was built with llama.cpp's AMX kernels, which usd-chat does not run (they "
            "crashed on this kind of CPU, and its exactness rule does not cover them). Rebuild it without them: "
            f'CMAKE_ARGS="{BUILD_ARGS}" pip install --force-reinstall --no-deps --no-cache-dir '
            f'"llama-cpp-python=={version("llama_cpp_python")}" (./dev.sh setup builds it so)'
        )


def last_errors() -> str:
    """llama.cpp's latest error lines, for a message (": ..."), or nothing."""
    errors = _state.get("errors") or []
    return f": {' / '.join(errors)}" if errors else ""


def cpu_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)
