#!/usr/bin/env bash
# The CUDA backend's check on a GPU host, in one run (< 8 minutes on an H200).
#
#   scripts/gpu-check.sh --build   # here (Rust toolchain): build the `cuda` release binaries and
#                                  # GPU test binaries into dist/gpu/ (stripped, < 64 MiB)
#   scripts/gpu-check.sh           # on the GPU host (NVIDIA driver + CUDA libraries; no Rust,
#                                  # no network): run from dist/gpu/
#   GPU_CHECK_QUICK=1 scripts/gpu-check.sh   # the defaults only (after changing them)
#
# The run: GPU tests (kernels, loader), then synthetic checkpoints made on the host
# (`bench-coldstart synth`: SmolLM2-shaped f32 and bf16, Llama-3-8B-shaped bf16), then
# `bench-coldstart gpu`: CUDA vs CPU logits and greedy ids (cuBLAS and matrix-vector products,
# queued and replayed as CUDA graphs), the small models' decode queued vs graphs, pinned H2D
# floor, 8B load GB/s and cold-start phases, load sweep (staging ring vs pinned in place),
# prefill A/B (tiled vs per-row attention), batch-1..32 decode A/Bs vs the HBM roofline — each
# check mode and decode mode in a process of its own, so a kernel that faults (a sticky CUDA
# error) costs its own line only; then `thaw serve --device cuda` answering /invoke, and fresh-process cold starts
# (`bench-coldstart coldstart`, --device cuda vs cpu). Results: $OUT/gpu-check.json, coldstart.md,
# the log (OUT defaults to target/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
dist=dist/gpu

if [ "${1:-}" = "--build" ]; then
    rm -rf "$dist" && mkdir -p "$dist"
    cargo build --release --features cuda -p thaw-runtime -p bench-coldstart
    cp target/release/thaw target/release/bench-coldstart "$dist/"
    # Test binaries with GPU tests: the kernels' library tests (device open, NVRTC compile, PTX
    # cache) and the loader's `cuda` test (pinned staging ring → device round trip). The CPU-only
    # tests (the emulator's among them) ran in CI already.
    cargo test --release --features cuda -p thaw-kernels -p thaw-loader --no-run \
        --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"].replace("-", "_")
        if name not in ("thaw_kernels", "cuda"):
            continue
        shutil.copy(m["executable"], sys.argv[1] + "/test-" + m["package_id"].split("#")[0].split("/")[-1].split("@")[0] + "-" + name)
' "$dist"
    strip "$dist"/thaw "$dist"/bench-coldstart "$dist"/test-*
    # The kernels' PTX for Hopper and Ampere, compiled here with the test venv's NVRTC, so the
    # GPU host needs no libnvrtc (it still recompiles if its driver refuses this PTX).
    nvrtc_lib="$("${THAW_HOME:-$HOME/.cache/thaw}/venv/bin/python" -c 'import os, nvidia.cuda_nvrtc as n; print(os.path.join(os.path.dirname(n.__file__), "lib"))' 2>/dev/null || true)"
    LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        target/release/thaw kernels --arch 9.0,8.0 --out "$dist/ptx" ||
        echo "no NVRTC here (run scripts/setup-test-deps.sh): the GPU host will compile the kernels itself"
    # SmolLM2's tokenizer (2 MB), so a `thaw serve --device cuda` on the SmolLM2-shaped synthetic
    # checkpoint answers real HTTP requests there (the weights are random: the text is noise).
    model=$(target/release/thaw model fetch | tail -1)
    mkdir -p "$dist/tokenizer"
    cp "$model/tokenizer.json" "$model/tokenizer_config.json" "$dist/tokenizer/"
    total=$(du -sb "$dist" | cut -f1)
    echo "dist/gpu: $total bytes"
    [ "$total" -lt $((64 << 20)) ] || { echo "dist/gpu is $total bytes: over the 64 MiB limit"; exit 1; }
    ls -la "$dist"
    exit 0
fi

out="${OUT:-target/gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
t0=$(date +%s)
[ -x "$dist/bench-coldstart" ] || { echo "no $dist/bench-coldstart: run scripts/gpu-check.sh --build first"; exit 1; }
nvidia-smi -L || true
nvidia-smi --query-gpu=driver_version,memory.total --format=csv || true

# cudarc looks for libnvrtc.so / libcublas.so (or .so.12 …). Hosts with other major versions
# (CUDA 13: .so.13) get links in a private directory: the unversioned name cudarc asks for, and
# every versioned name beside the library (libcublas.so.13 loads libcublasLt.so.13 by its soname,
# and NVRTC its builtins, from the directory it was opened from).
libs="$(mktemp -d)"
search="/usr/local /opt /usr/lib /usr/lib64"
for lib in nvrtc cublas cublasLt; do
    found=$( (ldconfig -p 2>/dev/null | awk -v l="lib$lib.so" '$1 ~ "^"l"(\\.|$)" {print $NF}';
              find $search \( -name "lib$lib.so.*" -o -name "lib$lib.so" \) 2>/dev/null) |
             grep -v -e builtins -e '\.alt\.' -e stub | sort -V | tail -1 || true)
    if [ -n "$found" ]; then
        dir=$(dirname "$found")
        ln -sf "$(readlink -f "$found")" "$libs/lib$lib.so"
        for f in "$dir"/lib$lib.so.* "$dir"/lib$lib-builtins.so*; do
            [ -e "$f" ] && ln -sf "$(readlink -f "$f")" "$libs/$(basename "$f")"
        done
        echo "lib$lib: $found"
    else
        echo "lib$lib: NOT FOUND"
    fi
done
ls -l "$libs"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
work="${GPU_CHECK_WORK:-/tmp/thaw-gpu-check}"
mkdir -p "$work"
# The PTX cache outside $OUT (only a few result files come back from there).
export THAW_HOME="$work/home"
mkdir -p "$THAW_HOME/ptx"
cp "$dist"/ptx/*.ptx "$dist"/ptx/*.cubin "$THAW_HOME/ptx/" 2>/dev/null || true
# Each stage under its own time limit: a hung kernel costs that stage, not the whole lease.
lim() { local s=$1; shift; timeout --kill-after=5 "$s" "$@"; }

status=0
echo "== GPU tests"
for t in "$dist"/test-*; do
    echo "-- $t"
    lim 120 "$t" --test-threads=1 --nocapture 2>&1 | grep -E "^test |skipped|result|panicked|error|loaded as" || status=1
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

echo "== synthetic checkpoints in $work ($(( $(date +%s) - t0 )) s)"
[ -f "$work/small-f32/config.json" ] || lim 120 "$dist/bench-coldstart" synth --shape smollm2-135m --dtype f32 --out "$work/small-f32"
[ -f "$work/small-bf16/config.json" ] || lim 120 "$dist/bench-coldstart" synth --shape smollm2-135m --dtype bf16 --out "$work/small-bf16"
# The same bf16 values widened to f32: the reference the bf16 check measures both backends by.
[ -f "$work/small-bf16-ref/config.json" ] || lim 120 "$dist/bench-coldstart" synth --shape smollm2-135m --dtype f32-from-bf16 --out "$work/small-bf16-ref"
big="${GPU_CHECK_BIG_SHAPE:-llama-3-8b}"  # a smaller shape only for dry runs of this script
[ -f "$work/$big/config.json" ] || lim 120 "$dist/bench-coldstart" synth --shape "$big" --dtype bf16 --out "$work/$big"

echo "== bench-coldstart gpu ($(( $(date +%s) - t0 )) s)"
# GPU_CHECK_QUICK=1: the defaults only (a confirmation run after changing them): no A/B lines,
# no load sweep, no ncu profile.
quick=${GPU_CHECK_QUICK:+--quick}
lim 360 "$dist/bench-coldstart" gpu --check "$work/small-f32" --check "$work/small-bf16=$work/small-bf16-ref" \
    --big "$work/$big" --out "$out/gpu-check.json" $quick || status=1

echo "== thaw serve --device cuda, end to end ($(( $(date +%s) - t0 )) s)"
cp "$dist"/tokenizer/* "$work/small-bf16/"
port=18431
"$dist/thaw" serve --device cuda --model "$work/small-bf16" --port $port > "$out/serve.log" 2>&1 &
spid=$!
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.2
done
if curl -sf -m 60 "http://127.0.0.1:$port/invoke" -H 'content-type: application/json' \
        -d '{"prompt": "Hello there", "max_tokens": 16, "ignore_eos": true}' > "$out/invoke.json"; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("invoke:", r.get("usage"), "timings", r.get("timings"))' "$out/invoke.json" || cat "$out/invoke.json"
    curl -s "http://127.0.0.1:$port/metrics" | grep -E "^thaw_cold_start_phase_seconds" || true
else
    echo "serve --device cuda: the request failed"; status=1
fi
kill -TERM $spid 2>/dev/null || true
wait $spid 2>/dev/null || true
grep -E "cold start|loaded|error" "$out/serve.log" | head -5 || true

echo "== cold start, fresh processes: thaw serve --device cuda vs --device cpu ($(( $(date +%s) - t0 )) s)"
lim 120 "$dist/bench-coldstart" coldstart --model "$work/small-bf16" --runs 3 --thaw-args="--device cuda" \
    --peer "$dist/thaw serve --device cpu --model $work/small-bf16 --port {port}" --peer-label "thaw cpu" \
    --svg "$work/coldstart-cuda.svg" 2>&1 | tee "$out/coldstart.md" || status=1

echo "== the same, the kernels and cuBLAS brought up beside the weight load (THAW_CUDA_OVERLAP_INIT=1) ($(( $(date +%s) - t0 )) s)"
THAW_CUDA_OVERLAP_INIT=1 lim 120 "$dist/bench-coldstart" coldstart --model "$work/small-bf16" --runs 3 \
    --thaw-args="--device cuda" --svg "$work/coldstart-overlap.svg" 2>&1 | tee "$out/coldstart-overlap.md" || status=1

echo "== cold start of the 8B-shaped checkpoint to first token, page cache dropped ($(( $(date +%s) - t0 )) s)"
# The serverless figure: a fresh `thaw serve --device cuda` with the weights on disk, not in
# memory (--cold drops the page cache before each run, root; the floor is one buffered read of
# the same files from the disk).
cp "$dist"/tokenizer/* "$work/$big/"
lim 150 "$dist/bench-coldstart" coldstart --model "$work/$big" --runs 2 --cold --thaw-args="--device cuda" \
    --svg "$work/coldstart-big.svg" 2>&1 | tee "$out/coldstart-big.md" || status=1

echo "== ncu: GPU time per kernel of one batch-1 decode step (matrix-vector kernel vs cuBLAS) and of a 512-token prefill ($(( $(date +%s) - t0 )) s)"
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
if [ -n "$quick" ]; then
    echo "skipped (GPU_CHECK_QUICK)"
elif [ -n "$ncu_bin" ]; then
    lim 150 "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv \
        --log-file "$out/ncu.csv" "$dist/bench-coldstart" gpu --big "$work/$big" --profile \
        --steps 1 --out "$work/profile.json" > "$work/ncu-run.log" 2>&1 || echo "ncu: exit $?"
    grep "profile:" "$work/ncu-run.log" || tail -5 "$work/ncu-run.log"
    python3 scripts/ncu-summary.py "$out/ncu.csv" || true
else
    echo "no ncu here"
fi

echo "== issue 7's aims, from $out/gpu-check.json"
python3 - "$out/gpu-check.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
big = r.get("big") or {}
h2d = r.get("pinned_h2d_bytes_per_s") or 0
if big.get("fraction_of_pinned_h2d") is not None:
    print(f"load (defaults): {100 * big['fraction_of_pinned_h2d']:.0f}% of pinned H2D (aim >= 80%)")
sweep = [x for x in r.get("load_sweep") or [] if x.get("gb_per_s")]
if sweep and h2d:
    b = max(sweep, key=lambda x: x["gb_per_s"])
    how = "pinned in place" if b.get("pin_in_place") else "staged"
    print(f"load (best of sweep): {100 * b['gb_per_s'] * 1e9 / h2d:.0f}% ({how}, {b['threads']} threads, {b['chunk'] >> 20} MiB)")
dec = big.get("decode") or []
for batch in (1, 8, 32):
    rows = [d for d in dec if d.get("batch") == batch]
    if not rows:
        continue
    d = next((d for d in rows if d["mode"] == "default"), None)
    b = max(rows, key=lambda d: d["tokens_per_s"])
    aim = " (aim >= 60%)" if batch == 1 else ""
    dflt = f"defaults {100 * d['fraction_of_roofline']:.0f}%, " if d else ""
    print(f"decode batch {batch}: {dflt}best {100 * b['fraction_of_roofline']:.0f}% ({b['mode']}) of the HBM roofline{aim}")
checks = r.get("checks") or []
print(f"errors: {len(r.get('errors') or [])} | checkpoints passing every check: {sum(1 for c in checks if c.get('pass'))}/{len(checks)}")
PY

echo "== done in $(( $(date +%s) - t0 )) s, status $status; results in $out/gpu-check.json"
exit $status
