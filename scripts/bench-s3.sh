#!/usr/bin/env bash
# Loading from S3, measured against a real S3 server on this machine: s3s-fs (a Rust
# S3-compatible server over a directory, from crates.io; installed once into $THAW_HOME/tools),
# which checks SigV4 signatures. The default model is pushed with `thaw model push`, then:
#   1. bench-coldstart load  — thaw's S3 load vs the same ranged GETs with the bytes discarded
#                              (the floor) and vs boto3's download_fileobj (the peer), alternated;
#   2. bench-coldstart coldstart — exec → first token of `thaw serve --model s3://…` against the
#                              floor + warm TTFT, and the same server from the local directory.
# The server is pinned to the last core (taskset) so that it cannot take every core from the
# client; the client is not pinned (the cold start's compute uses all cores).
# Usage: scripts/bench-s3.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
home="${THAW_HOME:-$HOME/.cache/thaw}"
tools="$home/tools"
s3s="$tools/bin/s3s-fs"
if [ ! -x "$s3s" ]; then
    echo "installing s3s-fs 0.14.1 into $tools (a few minutes, once)"
    cargo install --quiet s3s-fs@0.14.1 --features binary --root "$tools"
fi
bash scripts/setup-test-deps.sh  # boto3 comes with moto in $home/venv
cargo build --release --bins --quiet
server_cpu=$(($(nproc) - 1))
root=$(mktemp -d /tmp/thaw-s3-bench.XXXXXX)
mkdir -p "$root/models"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
taskset -c "$server_cpu" "$s3s" --host 127.0.0.1 --port "$port" \
    --access-key AKIDTHAWBENCH --secret-key 'bench/secret+key' "$root" >"$root.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$root" "$root.log"' EXIT
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$port") 2>/dev/null && break; sleep 0.05; done
export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_ACCESS_KEY_ID=AKIDTHAWBENCH \
    AWS_SECRET_ACCESS_KEY='bench/secret+key' AWS_REGION=us-east-1
model=$(./target/release/thaw model fetch)
./target/release/thaw model push "$model" s3://models/smollm2
./target/release/bench-coldstart load --model s3://models/smollm2 --runs "$runs" \
    --peer-boto3 "$home/venv/bin/python"
./target/release/bench-coldstart coldstart --model s3://models/smollm2 --runs "$runs" \
    --peer "$PWD/target/release/thaw serve --model $model --port {port}" \
    --peer-label "thaw, local directory" --svg docs/img/coldstart-smollm2-s3.svg
