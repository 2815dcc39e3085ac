#!/usr/bin/env bash
# The CUDA kernels as the GPU will run them, on a machine without one: NVRTC compiles the kernels
# to an sm_90 cubin (`thaw kernels`), and NVIDIA's cuobjdump/nvdisasm (PyPI wheels, installed
# once into $THAW_HOME/venv) print each kernel's registers, shared memory and stack, and on
# request its SASS — to see whether loads are issued together before the first use, or spill.
#
#   scripts/kernel-report.sh              # resource usage of every kernel (sm_90)
#   scripts/kernel-report.sh gemv1        # and that kernel's SASS, loads and branches marked
#   ARCH=8.0 scripts/kernel-report.sh     # another architecture
set -euo pipefail
cd "$(dirname "$0")/.."
home="${THAW_HOME:-$HOME/.cache/thaw}"
venv="$home/venv"
bash scripts/setup-test-deps.sh
if ! "$venv/bin/python" -c "import nvidia.cu13" 2>/dev/null ||
    [ ! -x "$("$venv/bin/python" -c 'import os, nvidia.cu13 as n; print(os.path.join(n.__path__[0], "bin", "nvdisasm"))' 2>/dev/null)" ]; then
    echo "installing cuobjdump and nvdisasm (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "nvidia-cuda-cuobjdump==13.5.37" "nvidia-cuda-nvdisasm==13.5.37"
fi
bin="$("$venv/bin/python" -c 'import os, nvidia.cu13 as n; print(os.path.join(n.__path__[0], "bin"))')"
chmod +x "$bin"/cuobjdump "$bin"/nvdisasm 2>/dev/null || true
nvrtc="$("$venv/bin/python" -c 'import os, nvidia.cuda_nvrtc as n; print(os.path.join(os.path.dirname(n.__file__), "lib"))')"
cargo build --release --features cuda -p thaw-runtime --bin thaw
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
arch="${ARCH:-9.0}"
LD_LIBRARY_PATH="$nvrtc" target/release/thaw kernels --arch "$arch" --out "$out" >/dev/null
# One cubin per kernel family (kernels/src/cuda/compile.rs: PARTS).
for cubin in "$out"/*.cubin; do
    PATH="$bin:$PATH" cuobjdump -res-usage "$cubin" |
        awk '/Function/ {f = $2} /REG:/ {print f, $1, $2, $3, $5}' | sed 's/:$//'
done | column -t
if [ -n "${1:-}" ]; then
    echo "== SASS of $1 (loads, branches, barriers, shuffles)"
    for cubin in "$out"/*.cubin; do
        PATH="$bin:$PATH" cuobjdump -sass -fun "$1" "$cubin" 2>/dev/null || true
    done | grep -E "LDG|STG|BRA|BAR|SHFL|LDS|STS" | sed 's@/\*[0-9a-fx]*\*/@@; s@ */\* 0x[0-9a-f]* \*/@@'
fi
