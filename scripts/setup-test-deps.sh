#!/usr/bin/env bash
# Test-only tools, installed once and reused:
# - $THAW_HOME/venv with the official `openai` client (tests/scripts/openai_client.py);
# - NVIDIA's NVRTC from PyPI (nvidia-cuda-nvrtc-cu12) in the same venv, so the CUDA kernels are
#   compiled (to PTX, no GPU needed) by the kernels crate's tests on every machine;
# - moto's S3 server (`moto[server]`, PyPI) in the same venv: the S3-compatible server the
#   S3 loading tests start (tests find it at $THAW_HOME/venv/bin/moto_server);
# - promtool (Debian package `prometheus`) to check /metrics.
set -euo pipefail
home="${THAW_HOME:-$HOME/.cache/thaw}"
venv="$home/venv"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    echo "setting up $venv with the openai client"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40"
fi
if ! "$venv/bin/python" -c "import nvidia.cuda_nvrtc" 2>/dev/null; then
    echo "installing NVRTC (nvidia-cuda-nvrtc-cu12) into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12==12.8.93"
fi
if ! "$venv/bin/python" -c "import moto.server" 2>/dev/null; then
    echo "installing moto's S3 server (moto[server]) into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "moto[server]==5.2.1"
fi
if ! command -v promtool >/dev/null; then
    echo "installing promtool (Debian package prometheus)"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null \
        || { $sudo apt-get update >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null; }
fi
