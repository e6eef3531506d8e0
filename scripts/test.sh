#!/usr/bin/env bash
# Set everything up, check lint, formatting and types (seconds), then run the test suite.
# Any finding stops the run before pytest starts. Without a GPU the GPU tier is skipped with a reason.
# pytest runs on TRACE_REPLAY_TEST_WORKERS processes (pytest-xdist; default 2, `auto`: one a CPU
# core, 1: one process), one test file per worker, so that a file's module-scoped fixtures are
# built once. On a machine whose `nvidia-smi -L` lists a GPU, the workers share it: JAX allocates
# GPU memory as it needs it (XLA_PYTHON_CLIENT_PREALLOCATE=false, not 75% of it in each worker), and
# the tests marked `alone` (they read the GPU's free memory) run afterwards in a pytest of their own.
# Arguments go to pytest (to both runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for tool in ruff mypy; do
  if [ ! -x ".venv/bin/$tool" ]; then
    echo "scripts/test.sh: .venv/bin/$tool is missing; install the lint extra: .venv/bin/pip install -e '.[lint]'" >&2
    exit 2
  fi
done
echo "ruff check" && .venv/bin/ruff check .
echo "ruff format --check" && .venv/bin/ruff format --check .
echo "mypy" && .venv/bin/mypy
workers="${TRACE_REPLAY_TEST_WORKERS:-2}"
case "$workers" in
  auto | [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;;
  *) echo "scripts/test.sh: TRACE_REPLAY_TEST_WORKERS must be a positive integer or auto (got '$workers')" >&2; exit 2 ;;
esac
if [ "$workers" = 1 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
fi
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
shared=0 alone=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile -m "not alone" "$@" || shared=$?
.venv/bin/python -m pytest -q -m alone "$@" || alone=$?
# 5: no test selected (arguments that name none of one kind)
if [ "$shared" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
for rc in "$shared" "$alone"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
