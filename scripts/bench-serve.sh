#!/usr/bin/env bash
# Serving benchmark, side by side: `thaw serve` (bf16) and llama.cpp's native `llama-server`
# (F16 and 4-bit Q4_1, continuous batching with -np N slots) under the same workload and
# protocol (`bench-coldstart serve --url`: 128 input ids, 128 output tokens with ignore_eos,
# greedy, streamed /v1/completions), at each concurrency. Peers: scripts/build-llama-cpp.sh.
# Usage: scripts/bench-serve.sh [CONCURRENCIES (default 1,4,16,64)] [extra bench args...]
set -euo pipefail
cd "$(dirname "$0")/.."
levels="${1:-1,4,16,64}"
shift || true
home="${THAW_HOME:-$HOME/.cache/thaw}"
peers="$home/peers"
out="${BENCH_OUT:-target/bench-serve}"
mkdir -p "$out"
cargo build --release --bins -q
bench=target/release/bench-coldstart
port=18080

wait_up() {  # URL PID
  for _ in $(seq 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

echo "== thaw serve (bf16)"
target/release/thaw serve --port $port --max-running 64 >"$out/thaw.log" 2>&1 &
pid=$!
wait_up "http://127.0.0.1:$port/ready" $pid
$bench serve --url "http://127.0.0.1:$port" --concurrency "$levels" --label "thaw bf16" "$@" --json | tee "$out/thaw.json" \
  | python3 -c 'import json,sys; [print("thaw bf16 c=%d: %.1f tok/s TTFT p50 %.0f p99 %.0f ms TPOT p50 %.1f ms" % (r["concurrency"], r["output_tokens_per_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"])) for r in json.load(sys.stdin)["results"]]'
kill -TERM $pid; wait $pid || true

if [ ! -x "$peers/llama.cpp/bin/llama-server" ]; then
  echo "llama-server not built: run scripts/build-llama-cpp.sh"; exit 0
fi
for w in F16 Q4_1; do
  for c in ${levels//,/ }; do
    echo "== llama-server $w -np $c"
    # Each slot gets ctx/np tokens: 320 per slot holds 128 in + 128 out.
    LD_LIBRARY_PATH="$peers/llama.cpp/lib" "$peers/llama.cpp/bin/llama-server" \
      -m "$peers/SmolLM2-135M-Instruct.$w.gguf" --host 127.0.0.1 --port $port \
      -np "$c" -c $((c * 320)) -t "$(nproc)" -cb >"$out/llama-$w-$c.log" 2>&1 &
    pid=$!
    wait_up "http://127.0.0.1:$port/health" $pid
    $bench serve --url "http://127.0.0.1:$port" --concurrency "$c" --label "llama-server $w -np $c" "$@" --json \
      | tee "$out/llama-$w-$c.json" \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); [print("%s: %.1f tok/s TTFT p50 %.0f p99 %.0f ms TPOT p50 %.1f ms failed %d" % (d["label"], r["output_tokens_per_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["failed"])) for r in d["results"]]'
    kill $pid; wait $pid 2>/dev/null || true
  done
done
