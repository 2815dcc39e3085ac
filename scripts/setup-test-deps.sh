#!/usr/bin/env bash
# Test-only tools, installed once and reused:
# - $THAW_HOME/venv with the official `openai` client (tests/scripts/openai_client.py);
# - promtool (Debian package `prometheus`) to check /metrics.
set -euo pipefail
home="${THAW_HOME:-$HOME/.cache/thaw}"
venv="$home/venv"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    echo "setting up $venv with the openai client"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40"
fi
if ! command -v promtool >/dev/null; then
    echo "installing promtool (Debian package prometheus)"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null \
        || { $sudo apt-get update >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null; }
fi
