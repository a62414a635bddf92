#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) as the peer for benchmarks/compare.py, with the tools
# the quantization benchmarks call beside it (llama-bench, llama-quantize, llama-perplexity).
#
#     benchmarks/peers/build_llama_server.sh        # prints the binary's path when done
#
# A documented, cached step outside CI: llama.cpp's sources come from the `llama-cpp-python`
# sdist on PyPI (it vendors them under vendor/llama.cpp), so only a package registry is needed.
# Everything lands in ${LLMSERVE_PEERS_DIR:-$HOME/.cache/llmserve/peers}:
#
#     peers/
#       llama_cpp_python-<ver>.tar.gz      the sdist
#       llama_cpp_python-<ver>/            unpacked; sources in vendor/llama.cpp
#       llama.cpp-<ver>-build/bin/llama-server
#
# Idempotent: when the binary exists, it prints its path and exits. About 6 minutes on 2 cores.
# Offline-safe flags: the server's web UI is neither downloaded (LLAMA_USE_PREBUILT_UI) nor
# built with npm (LLAMA_BUILD_UI), and HTTPS support (LLAMA_OPENSSL) is off. (LLAMA_CURL is only
# a deprecated no-op in this version, so it is not passed.)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS_DIR="${LLMSERVE_PEERS_DIR:-$HOME/.cache/llmserve/peers}"
JOBS="${JOBS:-2}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

SRC_DIR="$PEERS_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD_DIR="$PEERS_DIR/llama.cpp-$VERSION-build"
BINARY="$BUILD_DIR/bin/llama-server"

if [[ -x "$BINARY" && -x "$BUILD_DIR/bin/llama-perplexity" ]]; then
    echo "$BINARY"
    exit 0
fi
mkdir -p "$PEERS_DIR"

# 1. Fetch the sdist (pip skips the download when the file is already there).
SDIST="$PEERS_DIR/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS_DIR" >&2
fi

# 2. Unpack it.
if [[ ! -f "$SRC_DIR/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$PEERS_DIR"
fi

# 3. Configure and build the one target.
echo "building llama-server from $SRC_DIR into $BUILD_DIR" >&2
start=$(date +%s)
cmake -S "$SRC_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON >&2
# llama-server for compare.py; llama-bench (pp/tg), llama-quantize (Q8_0 from the F32 file) and
# llama-perplexity (--kl-divergence) for the quantization comparisons in docs/benchmarks.md.
cmake --build "$BUILD_DIR" --config Release -j"$JOBS" \
    --target llama-server llama-bench llama-quantize llama-perplexity >&2
echo "built in $(($(date +%s) - start)) s" >&2
echo "$BINARY"
