#!/usr/bin/env bash
# The peer benchmark: llama.cpp's llama-server on the default model's GGUF file
# against inferline through Kafka, one workload, one command (bench/peer_llamacpp.py).
#
# llama-server is built from the llama.cpp that PyPI's llama-cpp-python sdist vendors, with
# GGML_NATIVE=OFF and explicit x86 flags read from /proc/cpuinfo (`-march=native` builds die with
# SIGILL on some VMs: docs/benchmarks.md), only the llama-server target, cached under
# $INFERLINE_LLAMACPP_CACHE (default ~/.cache/inferline/llamacpp/<version>-<flags>). A benchmark
# tool, not a dependency: nothing of it is committed.
#
#   bench/peer_llamacpp.sh [--build-only] [bench/peer_llamacpp.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${INFERLINE_LLAMACPP_CACHE:-$HOME/.cache/inferline/llamacpp}
JOBS=${JOBS:-2}

# The x86 extensions ggml has a CMake switch for, as this CPU reports them.
cpu_flags() {
    local have flags=() f
    have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    for f in avx avx2 fma f16c bmi2 avx_vnni avx512f avx512vbmi avx512_vnni avx512_bf16; do
        [[ $have == *" $f "* ]] && flags+=("$f")
    done
    # ggml's GGML_AVX512 also turns on -mavx512cd/vl/dq/bw: ask for all of them.
    if [[ " ${flags[*]} " == *" avx512f "* ]]; then
        for f in avx512cd avx512vl avx512dq avx512bw; do
            [[ $have == *" $f "* ]] || { flags=("${flags[@]/avx512*/}"); break; }
        done
    fi
    echo "${flags[@]}" | tr -s ' '
}

cmake_flags() {  # "avx2 fma" -> -DGGML_AVX2=ON -DGGML_FMA=ON ...
    local f out=(-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF)
    for f in $1; do
        f=${f^^}; f=${f/AVX512F/AVX512}; f=${f/AVX512VBMI/AVX512_VBMI}; out+=("-DGGML_$f=ON")
    done
    echo "${out[@]}"
}

fetch_source() {  # -> the vendored llama.cpp folder, downloading the sdist once
    mkdir -p "$CACHE/src"
    local sdist
    sdist=$(ls -t "$CACHE"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
    if [[ -z $sdist ]]; then
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$CACHE/src" >&2
        sdist=$(ls -t "$CACHE"/src/llama_cpp_python-*.tar.gz | head -1)
    fi
    local dir=${sdist%.tar.gz}
    [[ -d $dir/vendor/llama.cpp ]] || tar xzf "$sdist" -C "$CACHE/src"
    echo "$dir/vendor/llama.cpp"
}

build() {  # -> the llama-server binary
    local src flags version tag out
    src=$(fetch_source)
    version=$(basename "$(dirname "$(dirname "$src")")"); version=${version#llama_cpp_python-}
    flags=$(cpu_flags)
    tag=$(echo "$flags" | tr ' ' '+'); tag=${tag:-generic}
    out="$CACHE/$version-$tag"
    if [[ ! -x $out/bin/llama-server ]]; then
        echo "building llama-server $version ($flags) in $out: 10-20 min on 2 cores" >&2
        # shellcheck disable=SC2046
        cmake -S "$src" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            $(cmake_flags "$flags") -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
        cmake --build "$out" --target llama-server -j "$JOBS" >&2
    fi
    echo "$out/bin/llama-server"
}

if [[ ${1:-} == --build-only ]]; then
    build
    exit 0
fi
server=$(build)
exec "$PYTHON" -m bench.peer_llamacpp --server-bin "$server" "$@"
