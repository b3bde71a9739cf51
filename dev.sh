#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs usd-chat and what it needs, then runs a task.
#   ./dev.sh test      lint (ruff) and the test suite (pulls the four registry-shipped models on first run; installs
#                      Debian's chromium for the browser test when it is missing and apt-get can run)
#   ./dev.sh test -m "not slow"   the fast tier: no model download, a few minutes
#   ./dev.sh app       pull the default pair and launch the chat UI
#   ./dev.sh setup     only the install (the first one builds llama.cpp from source for precision gguf: about 6-7 min on two idle cores)
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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$py" -m pip install -q --disable-pip-version-check --upgrade pip
    if [ -z "${TORCH_SPEC:-}" ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC="torch"; else TORCH_SPEC="torch==2.13.0"; fi
    fi
    "$py" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
    "$py" -m pip install -q --disable-pip-version-check -e ".[test]"
    if ! "$py" -c "import llama_cpp" >/dev/null 2>&1; then
        echo "building llama.cpp from source (llama-cpp-python, for precision gguf); this takes about 6-7 minutes" \
            "on two idle cores, longer on busy ones, once: pip caches the built wheel" >&2
    fi
    # without the multimodal library (mtmd), which usd-chat does not use: a fifth less to compile. llama-cpp-python
    # leaves llama.cpp's server, tools, examples, tests and curl out by itself. Without llama.cpp's AMX kernels, which
    # -march=native turns on where the CPU reports AMX: the runner's exactness rule does not cover them, and on an
    # AMX machine here their first tile load died with a general protection fault (usd/runners/llamacpp/binding.py).
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'}" \
        "$py" -m pip install -q --disable-pip-version-check -e ".[llamacpp]"
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
