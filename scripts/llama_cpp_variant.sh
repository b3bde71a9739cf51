#!/usr/bin/env bash
# Another build of llama.cpp's CPU library beside the project's own, to run the project on it without touching .venv:
# the exact-rows patch's AVX2 bodies on a CPU that has AVX-512 (-DGGML_NATIVE=OFF gives AVX2, FMA, F16C and BMI2
# only), or pip's own build without the patch (--unpatched), on this machine. The patch changes only ggml's CPU
# library, so a copy of .venv's llama_cpp package with that library swapped is the build it stands for.
#
#     scripts/llama_cpp_variant.sh DIR [--unpatched] [CMAKE_ARG ...]
#     scripts/llama_cpp_variant.sh /tmp/avx2 -DGGML_NATIVE=OFF
#     scripts/llama_cpp_variant.sh /tmp/unpatched --unpatched
#
# Then, from the repository root: USD_CHAT_CACHE=DIR/cache PYTHONPATH=DIR/pkg:. .venv/bin/python -m pytest
# tests/test_llamacpp.py (or usd bench, scripts/measure_verify_rows.py). DIR/cache shares the model files and
# datasets of the usual cache, and keeps its own measured costs: those of the usual library are not this one's.
# The kernels alone: gcc -O2 -o rows scripts/rows_kernels_bench.c -LDIR/pkg/llama_cpp/lib -l:libggml-cpu.so
# -l:libggml-base.so -Wl,-rpath,DIR/pkg/llama_cpp/lib && ./rows
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/llama_source.sh"  # the pinned source and patch dev.sh builds: llama_spec, llama_patch, llama_source
dir="${1:?usage: scripts/llama_cpp_variant.sh DIR [--unpatched] [CMAKE_ARG ...]}"
shift
patch="$root/$llama_patch"
if [ "${1:-}" = "--unpatched" ]; then
    patch=""
    shift
fi
py="$root/.venv/bin/python"
site="$("$py" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"
cache="${USD_CHAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/usd-chat}"

# DIR is emptied first: only where this script made it (its marker), never a folder of someone else's
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/.llama-cpp-variant" ]; then
    echo "$dir exists and this script did not make it: name a new folder (it is emptied on every run)" >&2
    exit 1
fi
rm -rf "$dir"
mkdir -p "$dir/src" "$dir/pkg" "$dir/cache"
touch "$dir/.llama-cpp-variant"
dir="$(cd "$dir" && pwd)"
llama_source "$py" "$dir/src" "$patch"
cmake -S "$llama_src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_OPENMP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF "$@" >"$dir/cmake.log" 2>&1
grep "CPU backend variant" "$dir/cmake.log" || true
cmake --build "$dir/build" --target ggml-cpu -j"$(nproc)" >"$dir/build.log"

cp -a "$site" "$dir/pkg/"
lib="$dir/pkg/llama_cpp/lib"
rm -f "$lib"/libggml-cpu.so*
cp -P "$dir"/build/bin/libggml-cpu.so* "$lib/"
for part in models datasets; do
    ln -sfn "$cache/$part" "$dir/cache/$part"
done
PYTHONPATH="$dir/pkg" "$py" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())'
echo "USD_CHAT_CACHE=$dir/cache PYTHONPATH=$dir/pkg:. runs the project on this build"
