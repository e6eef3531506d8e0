#!/usr/bin/env bash
# The whole benchmark suite, on a machine with a CUDA GPU and the packages already installed:
# launch, staging, placement, scaling (then logprob_rank, read_floor, jax_step and cli_run when
# those scripts exist), then the plots and summary tables. Every result lands in bench/results/
# (JSON with provenance, PNG, summary.md). Set BENCH_LOG_DIR to also keep each script's output
# in <dir>/<script>.log.
# A failing script does not stop the others; the exit status is non-zero if any failed.
# Each script is stopped after BENCH_TIMEOUT_S seconds (default 180) so that one hang cannot
# take the rest of the run with it.
# Usage: bash bench/run_all.sh   (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LIMIT="${BENCH_TIMEOUT_S:-180}"
export PYTHONPATH="$PWD:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG_DIR="${BENCH_LOG_DIR:-}"
if [ -n "$LOG_DIR" ]; then mkdir -p "$LOG_DIR"; fi
status=0
failed=()

run() {
  local script="$1" name
  name="$(basename "$script" .py)"
  echo "=== $script ($(date -u +%H:%M:%S))"
  local start=$SECONDS log=/dev/null
  if [ -n "$LOG_DIR" ]; then log="$LOG_DIR/$name.log"; fi
  timeout --kill-after=10 "$LIMIT" "$PY" "$script" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $script: exit $rc after $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo " (timed out)")"
  if [ "$rc" -ne 0 ]; then
    status=1
    failed+=("$script")
  fi
}

for script in bench/launch.py bench/staging.py bench/placement.py bench/scaling.py; do
  run "$script"
done
for script in bench/logprob_rank.py bench/read_floor.py bench/jax_step.py bench/cli_run.py; do
  if [ -f "$script" ]; then run "$script"; fi
done
run bench/plots.py

if [ "$status" -ne 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
fi
exit "$status"
