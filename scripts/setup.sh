#!/usr/bin/env bash
# Create .venv (if needed) and install trace-replay with torch, jax, test and bench extras.
# torch is pinned to a CPU-capable release (override with TRACE_REPLAY_TORCH="torch==X").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install --disable-pip-version-check -q "$@"; }
pip_q --upgrade pip
python -c 'import torch' 2>/dev/null || pip_q "${TRACE_REPLAY_TORCH:-torch==2.13.0}"
pip_q -e ".[torch,jax,test,bench]"
