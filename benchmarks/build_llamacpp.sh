#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server`, `llama-bench` and `llama-quantize`, the peers of
# benchmarks/side_by_side.py and benchmarks/real_size.py.
#
# Benchmark-only: prefixserve neither needs nor uses llama.cpp, and this script is not part of
# the README's run/test commands (`make run`, `make test`). It takes the llama.cpp sources that
# the llama-cpp-python==0.3.36 sdist vendors (the same llama.cpp as the `llamacpp` row's
# Python server) and builds them, CPU only, outside the repository:
#
#     benchmarks/build_llamacpp.sh [BUILD_DIR]    # default $LLAMACPP_BUILD_DIR or /work/llamacpp-build
#     BUILD_DIR/bin/llama-bench -m MODEL.gguf -t 2 -n 128 -p 0
#     .venv/bin/python benchmarks/side_by_side.py --llama-server BUILD_DIR/bin/llama-server
#
# Native build (-march=native) with AMX off: a native build with AMX crashed at the first
# evaluation on an AMX machine. Under GGML_NATIVE the GGML_AMX_* options do not reach the
# compiler (ggml keys its AMX code on the compiler's own __AMX_INT8__ macro, which
# -march=native defines on such CPUs), so -mno-amx-* is passed as well; it changes nothing on
# CPUs without AMX. No HTTPS/curl (models are local files) and no web UI download.
# Needs python3 with pip (PyPI reachable), cmake >= 3.18 and a C++17 compiler; takes tens of
# minutes on 2 cores. JOBS (default 2) sets the parallel compile jobs.
set -euo pipefail

VERSION=0.3.36
BUILD_DIR=$(realpath -m "${1:-${LLAMACPP_BUILD_DIR:-/work/llamacpp-build}}")
SRC_DIR="$BUILD_DIR/src"
SDIST="$SRC_DIR/llama_cpp_python-$VERSION.tar.gz"
LLAMA_DIR="$SRC_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
PYTHON=${PYTHON:-python3}

mkdir -p "$SRC_DIR"
if [[ ! -f "$SDIST" ]]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" \
        -d "$SRC_DIR"
fi
if [[ ! -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$SRC_DIR"
fi

NO_AMX=""
if [[ "$(uname -m)" == x86_64 ]]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD_DIR" --config Release -j "${JOBS:-2}" --target llama-server llama-bench llama-quantize

echo "llama-server: $BUILD_DIR/bin/llama-server"
echo "llama-bench:  $BUILD_DIR/bin/llama-bench"
echo "llama-quantize: $BUILD_DIR/bin/llama-quantize"
