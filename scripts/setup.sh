#!/usr/bin/env bash
# Create .venv (if needed) and install trace-replay with the torch, jax, test, bench and lint extras,
# and on a machine whose `nvidia-smi -L` lists a GPU the gpu extra too (JAX's CUDA build; torch's
# CUDA build). TRACE_REPLAY_GPU=1 or 0 overrides that choice either way. torch is pinned to a
# release whose PyPI wheels exist for CPU and CUDA machines (override with TRACE_REPLAY_TORCH="torch==X").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
gpu="${TRACE_REPLAY_GPU:-}"
if [ -z "$gpu" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then gpu=1; else gpu=0; fi
fi
case "$gpu" in
  1) extras="torch,jax,gpu,test,bench,lint" ;;
  0) extras="torch,jax,test,bench,lint" ;;
  *) echo "scripts/setup.sh: TRACE_REPLAY_GPU must be 1, 0 or unset (got '$gpu')" >&2; exit 2 ;;
esac
echo "scripts/setup.sh: installing .[$extras] (GPU build: $([ "$gpu" = 1 ] && echo yes || echo no))"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install --disable-pip-version-check -q "$@"; }
pip_q --upgrade pip
torch_spec="${TRACE_REPLAY_TORCH:-torch==2.13.0}"
if [ "$gpu" = 1 ] && python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  python -m pip uninstall -y -q torch  # a CPU build: PyPI's Linux wheels are the CUDA builds
fi
python -c 'import torch' 2>/dev/null || pip_q "$torch_spec"
pip_q -e ".[$extras]"
