# The llama-cpp-python this project pins, the patch it builds with, and how to lay out that source. Sourced, not run:
# dev.sh builds the project's wheel from it and scripts/llama_cpp_variant.sh builds other variants from the same steps.
llama_spec="llama-cpp-python==0.3.36"
llama_patch=patches/llama-cpp-python-exact-rows.patch  # from the repository's root

# llama_source PY DIR [PATCH]: the pinned source downloaded into DIR and unpacked, with PATCH (a path from the
# current folder) applied when one is named. Sets llama_src to the source folder; a failed step stops the caller
# (set -e): it is not called in a command substitution, where bash would not stop at a failed step.
llama_source() {
    local py="$1" dir="$2" patch="${3:-}"
    [ -z "$patch" ] || patch="$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")"
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "$llama_spec" -d "$dir"
    tar xzf "$dir"/llama_cpp_python-*.tar.gz -C "$dir"
    llama_src="$(echo "$dir"/llama_cpp_python-*/)"
    [ -z "$patch" ] || (cd "$llama_src" && git apply -p1 "$patch")
}
