#!/usr/bin/env bash
# Builds llama.cpp's native tools (llama-bench, llama-server, llama-quantize) from the
# llama-cpp-python source package on PyPI, for side-by-side benchmarks, and makes the default
# model's F16 GGUF (the same weights as thaw's bf16 conversion, dequantized from the Q4_1 file).
# Output: $THAW_HOME/peers/llama.cpp/bin/…, $THAW_HOME/peers/SmolLM2-135M-Instruct.{F16,Q4_1}.gguf
# With --python, also installs llama-cpp-python (for `bench-coldstart load --peer-llama-cpp`).
set -euo pipefail
home="${THAW_HOME:-$HOME/.cache/thaw}"
peers="$home/peers"
mkdir -p "$peers"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if [ ! -x "$peers/llama.cpp/bin/llama-bench" ]; then
  command -v cmake >/dev/null || python3 -m pip install --quiet cmake ninja
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --no-binary=llama-cpp-python "llama-cpp-python==$version" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)"
  cmake -S "$src" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_INSTALL_PREFIX="$peers/llama.cpp" -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib'
  cmake --build "$tmp/build" -j"$(nproc)" --target llama-bench llama-server llama-quantize
  mkdir -p "$peers/llama.cpp/bin" "$peers/llama.cpp/lib"
  cp "$tmp"/build/bin/llama-bench "$tmp"/build/bin/llama-server "$tmp"/build/bin/llama-quantize "$peers/llama.cpp/bin/"
  cp -P "$tmp"/build/bin/*.so* "$peers/llama.cpp/lib/"
  rm -rf "$tmp"
fi
cargo run --release -q -p thaw-runtime --bin thaw -- model fetch >/dev/null
q41="$home/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
cp -n "$q41" "$peers/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$peers/SmolLM2-135M-Instruct.F16.gguf" ]; then
  LD_LIBRARY_PATH="$peers/llama.cpp/lib" "$peers/llama.cpp/bin/llama-quantize" --allow-requantize "$q41" "$peers/SmolLM2-135M-Instruct.F16.gguf" F16 >/dev/null
fi
# The load benchmark's llama.cpp peer goes through llama-cpp-python (same version, built here).
if [ "${1:-}" = "--python" ] && ! python3 -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
    python3 -m pip install --quiet --no-binary=llama-cpp-python "llama-cpp-python==$version"
fi
echo "$peers"
