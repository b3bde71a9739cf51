#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs usd-chat and what it needs, then runs a task.
#   ./dev.sh test      lint (ruff) and the test suite (pulls the four registry-shipped models on first run; installs
#                      Debian's chromium for the browser test when it is missing and apt-get can run)
#   ./dev.sh test -m "not slow"   the fast tier: no model download, a few minutes
#   ./dev.sh app       pull the default pair and launch the chat UI
#   ./dev.sh setup     only the install (the first one builds llama.cpp from source for precision gguf: about 6-7 min
#                      on two idle cores)
# TORCH_SPEC overrides the torch requirement (default: the CPU build torch==2.13.0 when no NVIDIA GPU is visible).
set -euo pipefail
cd "$(dirname "$0")"

task="${1:-test}"
shift || true

if [ ! -x .venv/bin/python ]; then
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "usd-chat needs Python >= 3.11 (found $(python3 --version))" >&2; exit 1; }
    python3 -m venv .venv
fi
py=.venv/bin/python
stamp=.venv/.usd-installed
. scripts/llama_source.sh  # llama_spec, llama_patch, llama_source

# llama.cpp for precision gguf, built from llama-cpp-python's source with usd-chat's exact-rows patch (a verify of up to
# 16 tokens in one call, each row with a single step's bits: usd/runners/llamacpp/kernels.py). The wheel is kept per
# patch and CPU (the build is for this CPU's instructions) and reused. Without the multimodal library (mtmd), which
# usd-chat does not use. Where the CPU reports AMX, -march=native builds llama.cpp's AMX kernels, and the patch mends
# their tile config (GCC 12 dropped its stores, and the first tile load died with a general protection fault) and
# leaves them to the copy of a model that reads prompts (usd/runners/llamacpp/twin.py).
# Without OpenMP: llama.cpp's own threads run a step as fast from the app's worker threads as from the thread that
# loaded the model, and OpenMP's do not (binding.py, OPENMP_HINT).
install_llama_cpp() {
    local key wheels src ours cmake_args
    ours="-DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF"
    cmake_args="${CMAKE_ARGS:-$ours}"
    if "$py" -c "import ctypes, llama_cpp; cpu = ctypes.CDLL('libggml-cpu.so.0')
cpu.ggml_cpu_set_exact_rows, cpu.ggml_cpu_set_amx_weights
assert llama_cpp.__version__.split('+')[0] == '${llama_spec#*==}'
assert b'OPENMP = 1' not in llama_cpp.llama_print_system_info()" >/dev/null 2>&1 \
        && [ ! "$llama_patch" -nt "$stamp" ]; then
        return
    fi
    key="$(cat "$llama_patch" <(echo "$cmake_args") <(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) \
        | sha256sum | cut -c1-16)"
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/usd-chat/wheels/llama-cpp-python-$key"
    if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
        echo "building llama.cpp from source (llama-cpp-python with $llama_patch, for precision gguf); this takes" \
            "about 6-7 minutes on two idle cores, longer on busy ones, once: the wheel is kept in $wheels" >&2
        src="$(mktemp -d)"
        trap 'rm -rf "$src" "$wheels.part"' EXIT  # an interrupted build leaves nothing behind
        llama_source "$py" "$src" "$llama_patch"
        rm -rf "$wheels.part"
        CMAKE_ARGS="$cmake_args" "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels.part" \
            "$llama_src"
        mkdir -p "$(dirname "$wheels")" && mv "$wheels.part" "$wheels"
        rm -rf "$src"
        trap - EXIT
    fi
    "$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/*.whl
}

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$llama_patch" -nt "$stamp" ] \
    || [ dev.sh -nt "$stamp" ] || [ scripts/llama_source.sh -nt "$stamp" ]; then
    "$py" -m pip install -q --disable-pip-version-check --upgrade pip
    if [ -z "${TORCH_SPEC:-}" ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC="torch"; else TORCH_SPEC="torch==2.13.0"; fi
    fi
    "$py" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
    "$py" -m pip install -q --disable-pip-version-check -e ".[test]"
    install_llama_cpp
    "$py" -m pip install -q --disable-pip-version-check -e ".[llamacpp]"  # llama-cpp-python's own dependencies
    touch "$stamp"
fi

case "$task" in
    setup) echo "installed into .venv" ;;
    test)
        if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
            sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
            { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium; } >/dev/null 2>&1 \
                || echo "note: could not install chromium; the browser test will be skipped" >&2
        fi
        .venv/bin/ruff check .
        .venv/bin/ruff format --check .
        .venv/bin/mypy usd
        exec .venv/bin/python -m pytest "$@"
        ;;
    app) exec .venv/bin/usd-chat "$@" ;;
    *) echo "usage: ./dev.sh {test|app|setup} [args...]" >&2; exit 2 ;;
esac
