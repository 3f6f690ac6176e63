#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-batched-bench (CPU only) outside the
# source tree, from the llama.cpp checkout vendored in the llama-cpp-python==0.3.36 sdist, and make
# an F32 GGUF from the bundled SmolLM2 Q4_1 file so every system computes with identical weights, and a
# Q8_0 GGUF of those weights.
#
#   scripts/build_llama_cpp.sh [BUILD_DIR]      # default: $HOME/.cache/conveyor-peers
#
# Idempotent: each stage is skipped when its output exists. About 12 minutes on 2 cores.
# Environment: PYTHON (default: .venv/bin/python of this repository, else python3), JOBS (default 2).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-$HOME/.cache/conveyor-peers}"
JOBS="${JOBS:-2}"
VERSION="0.3.36"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then PYTHON="$REPO_DIR/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
case "$BUILD_DIR/" in
    "$REPO_DIR"/*) echo "error: build dir $BUILD_DIR is inside the repository; pick one outside it" >&2; exit 2 ;;
esac
SDIST="$BUILD_DIR/llama_cpp_python-$VERSION.tar.gz"
SRC="$BUILD_DIR/llama.cpp"
BIN="$SRC/build/bin"
log() { echo "[build_llama_cpp] $*"; }

# 1. The sdist (pip is the ordinary client for PyPI).
if [[ ! -f "$SDIST" ]]; then
    log "downloading the llama-cpp-python==$VERSION sdist into $BUILD_DIR"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD_DIR"
fi
[[ -f "$SDIST" ]] || { echo "error: $SDIST not found after pip download" >&2; ls "$BUILD_DIR" >&2; exit 1; }

# 2. vendor/llama.cpp out of the sdist.
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    log "extracting vendor/llama.cpp"
    tmp="$(mktemp -d "$BUILD_DIR/extract.XXXXXX")"
    tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    rm -rf "$SRC"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -rf "$tmp"
fi

# The sdist carries no .git, so the binary reports commit "unknown"; the release's changelog names it.
if [[ ! -s "$SRC/COMMIT" ]]; then
    tar -xzf "$SDIST" -O "llama_cpp_python-$VERSION/CHANGELOG.md" \
        | awk -v v="## [$VERSION]" '$0 == v {found=1; next} found && /^## \[/ {exit} found' \
        | grep -o 'llama\.cpp@[0-9a-f]*' | head -1 | cut -d@ -f2 > "$SRC/COMMIT" || true
    log "llama.cpp commit (from the llama-cpp-python $VERSION changelog): $(cat "$SRC/COMMIT")"
fi

# 3. The three tools.
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-quantize" && -x "$BIN/llama-batched-bench" ]]; then
    log "binaries present in $BIN"
else
    log "configuring (Release, CPU only)"
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DBUILD_SHARED_LIBS=OFF
    log "building with -j$JOBS"
    cmake --build "$SRC/build" --config Release -j "$JOBS" \
        --target llama-server llama-quantize llama-batched-bench
fi

# 4. The F32 GGUF made from the bundled Q4_1 file.
Q4_1="$("$PYTHON" -c 'from conveyor.model.checkpoint import default_model_path; print(default_model_path())')"
F32="$BUILD_DIR/SmolLM2-135M-Instruct.F32.gguf"
if [[ ! -s "$F32" ]]; then
    log "requantizing $Q4_1 -> $F32"
    "$BIN/llama-quantize" --allow-requantize "$Q4_1" "$F32.tmp" F32
    mv "$F32.tmp" "$F32"
fi

# 5. A Q8_0 GGUF of the same weights, the peer of `--quantization int8` and of conveyor on Q8_0.
Q8_0="$BUILD_DIR/SmolLM2-135M-Instruct.Q8_0.gguf"
if [[ ! -s "$Q8_0" ]]; then
    log "quantizing $F32 -> $Q8_0"
    "$BIN/llama-quantize" "$F32" "$Q8_0.tmp" Q8_0
    mv "$Q8_0.tmp" "$Q8_0"
fi

COMMIT="$(cat "$SRC/COMMIT" 2>/dev/null || echo unknown)"
log "done: $BIN/llama-server (llama.cpp $COMMIT)"
log "      Q4_1: $Q4_1"
log "      F32:  $F32"
log "      Q8_0: $Q8_0"
