"""llama-cpp-python's low-level API, loaded once: the library with its backend initialised and its log kept for our
error messages, and how to install it when it is missing."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import version

from ...errors import InternalError

GGML_TYPE_F16, GGML_TYPE_BF16 = 1, 30  # ggml.h's enum ggml_type (the binding names no BF16)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that leave llama.cpp's AMX kernels out of a build for the builder's own CPU: a build without the
patch must (see `_amx_switch`)."""
NO_OPENMP = "-DGGML_OPENMP=OFF"
"""llama.cpp on its own threads instead of OpenMP's (see `OPENMP_HINT`)."""
BUILD_ARGS = (
    "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    f"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF {NO_OPENMP} -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"
)
INSTALL_HINT = (
    "precision gguf runs the model's GGUF on llama.cpp, through llama-cpp-python, which is not installed. It builds "
    "llama.cpp from source (a few minutes, once): "
    f'CMAKE_ARGS="{BUILD_ARGS}" pip install "usd-chat[llamacpp]" '
    "(./dev.sh setup does this). Or choose --precision fp32 / bf16 to run the model on transformers."
)


EXACT_ROWS = 16
"""The most rows whose products patches/llama-cpp-python-exact-rows.patch gives each row its one-row bits in (its
GGML_CPU_EXACT_ROWS_MAX): a verify of up to this many tokens is one llama_decode call."""
EXACT_ROWS_ENV = "USD_EXACT_ROWS"
"""Set to 0 to run a patched llama.cpp on the unpatched rule (for side-by-side measurements)."""
AMX_PREFILL_ENV = "USD_AMX_PREFILL"
"""Set to 0 to read prompts on the same kernels as plain steps where AMX tiles would read them (twin.py)."""
PATCH_HINT = (
    "llama.cpp without usd-chat's exact-rows patch (pip's own build): a verify runs in calls of at most 3 tokens, "
    "so it costs about a plain step per token; ./dev.sh setup builds the patched llama.cpp"
)

OPENMP_HINT = (
    "llama.cpp built with OpenMP (as pip builds it): a step run on a thread other than the one that first used OpenMP "
    "in this process (the app's and the server's worker threads) is slower; ./dev.sh setup builds llama.cpp on its "
    "own threads"
)
"""Why: llama.cpp's barriers are then OpenMP barriers, and libgomp (one copy per process, shared with torch) keeps a
pool of threads for every thread that opens a parallel region. Once those outnumber the CPUs, libgomp makes a waiting
thread sleep almost at once instead of spinning, and a step has hundreds of barriers; no environment variable lifts
that. docs/benchmarks.md ("llama.cpp on its own threads") has the measurement."""


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

        system_info = llama_cpp.llama_print_system_info()
        amx = _amx_switch(system_info)
        llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _state.update(lib=llama_cpp, log=log, errors=errors)  # the callback must outlive every call into llama.cpp
        _state.update(_exact_rows())
        _state.update(_amx_prefill(amx))
        openmp = b"OPENMP = 1" in system_info  # its threads are OpenMP's: no pools of llama.cpp's own to keep
        _state["threadpools"] = None if openmp else Threadpools(llama_cpp.llama_cpp._lib)
        return llama_cpp


def _exact_rows() -> dict:
    """Turn the patch's exact rows on where the library has them: {"exact_rows": rows, "exact_why": reason}."""
    try:
        # the name, not a path: dlopen then returns the copy libllama loaded (the wheel's files are copies, and a
        # second copy would keep a setting of its own)
        setter = ctypes.CDLL("libggml-cpu.so.0").ggml_cpu_set_exact_rows
    except (OSError, AttributeError):
        return {"exact_rows": 0, "exact_why": PATCH_HINT}
    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    off = os.environ.get(EXACT_ROWS_ENV, "").strip() == "0"
    rows = setter(0 if off else EXACT_ROWS)
    return {"exact_rows": rows, "exact_why": f"{EXACT_ROWS_ENV}=0" if off else "", "set_exact_rows": setter}


def exact_rows() -> int:
    """How many rows a llama_decode call may verify with each getting its one-row bits (0: the unpatched rule)."""
    library()
    return _state["exact_rows"]


def exact_rows_off(why: str) -> None:
    """Back to the unpatched rule for the rest of the process, `why` kept for the load line: a check at load found
    the rows not invariant on this CPU (model.py)."""
    set_exact_rows(0)
    _state.update(exact_rows=0, exact_why=why)


def set_exact_rows(n: int) -> None:
    """llama.cpp's own switch (the patch's ggml_cpu_set_exact_rows), without changing the rule models load with: for
    exact_rows_off and for measurements of both rules in one process."""
    library()
    _state["set_exact_rows"](n)


def exact_rows_why() -> str:
    """Why exact rows are off (empty when on)."""
    library()
    return _state["exact_why"]


def threads_why() -> str:
    """What the build's threading costs (empty for llama.cpp on its own threads)."""
    return OPENMP_HINT if threadpools() is None else ""


GGML_MAX_N_THREADS = 512  # ggml.h


POLL = 0
"""How long a pool's idle threads spin for the next graph before they sleep (ggml's 0-100; its default polls). A pair
has two pools, the target's and the drafter's, on the same cores, and they take turns: a pool that spins after its
turn takes the cores from the other's, which then computes on fewer (a drafter step and the verify after it took
several times as long; docs/benchmarks.md, "Two thread pools"). Sleeping costs a wake-up per llama_decode, nothing
measurable next to a step."""


class _ThreadpoolParams(ctypes.Structure):
    """ggml.h's struct ggml_threadpool_params."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class Threadpools:
    """Pools of llama.cpp's own threads, one per context for its whole life, on a build without OpenMP. A context
    without one starts and joins its threads at every llama_decode, which measured slower than a kept pool
    (docs/benchmarks.md, "llama.cpp on its own threads")."""

    def __init__(self, libllama):
        # by name, as in _exact_rows: the copies libllama loaded
        base, cpu = ctypes.CDLL("libggml-base.so.0"), ctypes.CDLL("libggml-cpu.so.0")
        self._init = base.ggml_threadpool_params_init
        self._init.argtypes, self._init.restype = [ctypes.POINTER(_ThreadpoolParams), ctypes.c_int], None
        self._new = cpu.ggml_threadpool_new
        self._new.argtypes, self._new.restype = [ctypes.POINTER(_ThreadpoolParams)], ctypes.c_void_p
        self._free = cpu.ggml_threadpool_free
        self._free.argtypes, self._free.restype = [ctypes.c_void_p], None
        self._attach = libllama.llama_attach_threadpool
        self._attach.argtypes, self._attach.restype = [ctypes.c_void_p] * 3, None

    def attach_new(self, ctx, n_threads: int) -> Callable[[], None]:
        """A new pool of `n_threads` attached to llama.cpp context `ctx`; returns what frees it, after the context."""
        if not 1 <= n_threads <= GGML_MAX_N_THREADS:
            raise InternalError(f"a llama.cpp thread pool of {n_threads} threads")
        params = _ThreadpoolParams()
        self._init(ctypes.byref(params), n_threads)
        params.poll = POLL
        pool = self._new(ctypes.byref(params))
        if not pool:
            raise RuntimeError(f"llama.cpp could not start {n_threads} threads{last_errors()}")
        self._attach(ctx, pool, pool)
        return functools.partial(self._free, pool)


def threadpools() -> Threadpools | None:
    """Where contexts get kept pools of llama.cpp's own threads (None on an OpenMP build: its threads are OpenMP's)."""
    library()
    return _state["threadpools"]


def _amx_switch(system_info: bytes) -> Callable[[int], int] | None:
    """The patch's ggml_cpu_set_amx_weights where the build has llama.cpp's AMX kernels (what -march=native compiles
    where the CPU reports AMX), else None. A build with them but without the patch is refused before it runs: its AMX
    buffer would take every model's K-quant weights, off the kernels the exactness rule is measured on (kernels.py),
    and built by GCC 12 its first tile-config load dies with a general protection fault, which kills the process (GCC
    does not see that ldtilecfg reads the whole 64-byte config built on the stack and drops the stores of its rows and
    widths; the patch mends it and leaves the AMX buffer to the models that ask for it)."""
    if b"AMX_INT8 = 1" not in system_info:
        return None
    try:
        switch = ctypes.CDLL("libggml-cpu.so.0").ggml_cpu_set_amx_weights  # by name, as in _exact_rows
    except (OSError, AttributeError):
        raise LlamaCppUnavailable(
            "this llama-cpp-python was built with llama.cpp's AMX kernels but without usd-chat's patch, and usd-chat "
            "does not run that (they crashed on this kind of CPU, and its exactness rule does not cover them). "
            "./dev.sh setup builds the patched llama.cpp; or rebuild it without them: "
            f'CMAKE_ARGS="{BUILD_ARGS}" pip install --force-reinstall --no-deps --no-cache-dir '
            f'"llama-cpp-python=={version("llama_cpp_python")}"'
        ) from None
    switch.argtypes, switch.restype = [ctypes.c_int], ctypes.c_int
    return switch


def _amx_prefill(switch: Callable[[int], int] | None) -> dict:
    """Whether models read prompts on AMX tiles (twin.py): {"amx_switch": the switch or None, "amx_why": why not,
    where the CPU and the build have AMX}."""
    if switch is None:
        return {"amx_switch": None, "amx_why": ""}
    if os.environ.get(AMX_PREFILL_ENV, "").strip() == "0":
        return {"amx_switch": None, "amx_why": f"{AMX_PREFILL_ENV}=0"}
    if not switch(1):  # the kernel refused the tile data permission (llama.cpp printed why)
        return {"amx_switch": None, "amx_why": "the operating system refused this process the AMX tiles"}
    switch(0)
    return {"amx_switch": switch, "amx_why": ""}


def amx_prefill() -> bool:
    """Whether a model loaded now gets a twin that reads its prompts on the AMX tiles (twin.py)."""
    library()
    return _state["amx_switch"] is not None


def amx_prefill_off(why: str) -> None:
    """No more twins in this process, `why` kept for the load line: a check at load found a twin's rows not the same
    bits in every batch (twin.py)."""
    library()
    _state.update(amx_switch=None, amx_why=why)


def amx_prefill_why() -> str:
    """Why prompts are not read on AMX tiles although the CPU and the build have them (empty otherwise)."""
    library()
    return _state["amx_why"]


@contextlib.contextmanager
def amx_weights() -> Iterator[None]:
    """Models loaded inside put their weights in llama.cpp's AMX buffer (the patch's switch is process-wide: one load at
    a time)."""
    switch = _state["amx_switch"]
    if switch is None:
        raise InternalError("a model on AMX tiles without AMX (check amx_prefill first)")
    with _load_lock:
        switch(1)
        try:
            yield
        finally:
            switch(0)


_load_lock = threading.Lock()


def last_errors() -> str:
    """llama.cpp's latest error lines, for a message (": ..."), or nothing."""
    errors = _state.get("errors") or []
    return f": {' / '.join(errors)}" if errors else ""
