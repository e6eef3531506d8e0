#!/usr/bin/env bash
# The benchmark suite on a machine with a CUDA GPU and the packages already installed: every
# bench below, then plots.py (the PNGs) and summary.py (results/summary.md and the figures in
# bench/README.md). Results land in bench/results/ (JSON with provenance).
# A failing script does not stop the others; the exit status is non-zero if any failed.
# Each script is stopped after BENCH_TIMEOUT_S seconds (default 180; jax_step.py and each of the
# three parts of models.py's sweep at least 400) so that one hang cannot take the rest of the
# run with it; models.py's parts merge their rows into one results file (--append).
# BENCH_LOG_DIR=dir also keeps each script's output in dir/<script>.log.
# Usage: bash bench/run_all.sh   (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LIMIT="${BENCH_TIMEOUT_S:-180}"
LONG=$((LIMIT > 400 ? LIMIT : 400))
export PYTHONPATH="$PWD:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG_DIR="${BENCH_LOG_DIR:-}"
if [ -n "$LOG_DIR" ]; then mkdir -p "$LOG_DIR"; fi
status=0
failed=()

run() {  # run <script> <seconds> [arguments...]
  local script="$1" limit="$2" name
  shift 2
  name="$(basename "$script" .py)${1:+_$(printf '%s' "$*" | tr -c 'A-Za-z0-9,.' '_')}"
  echo "=== $script $* ($(date -u +%H:%M:%S))"
  local start=$SECONDS log=/dev/null
  if [ -n "$LOG_DIR" ]; then log="$LOG_DIR/$name.log"; fi
  timeout --kill-after=10 "$limit" "$PY" "$script" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $script $*: exit $rc after $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo " (timed out)")"
  if [ "$rc" -ne 0 ]; then
    status=1
    failed+=("$script")
  fi
}

for script in launch staging placement scaling logprob_rank cli_run; do
  run "bench/$script.py" "$LIMIT"
done
run bench/jax_step.py "$LONG"
run bench/models.py "$LONG" --batches 64,256
run bench/models.py "$LONG" --batches 1,8,512 --providers torch,jax,generate-static --append
run bench/models.py "$LONG" --shape llama3-8b --append
run bench/step_profile.py "$LIMIT" --write
run bench/models_plot.py "$LIMIT"
run bench/plots.py "$LIMIT"
run bench/summary.py "$LIMIT"

if [ "$status" -ne 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
fi
exit "$status"
