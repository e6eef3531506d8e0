#!/usr/bin/env bash
# Run the GPU test tier and the GPU benchmarks on a machine with a CUDA GPU, using the
# packages already installed there (no install step). Logs and results go to $OUT (default
# ./gpu-out). Usage: scripts/gpu_tier.sh [tests] [tests-parallel] [sanitizer] [sanitizer-logprob]
# [profile-logprob] [profile-logprob-source] [tune-logprob] [demo] [cli] [bench-core] [bench-all]
# [bench-NAME] ...
# Results files record the commit measured: from git when this tree is a checkout, else from
# TRACE_REPLAY_COMMIT=<hash>[-dirty] set by the caller (a copy of the tree without .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -z "${TRACE_REPLAY_COMMIT:-}" ] && git rev-parse --is-inside-work-tree >/dev/null 2>&1 && [ -e .git ]; then
  TRACE_REPLAY_COMMIT="$(git rev-parse HEAD)"
  [ -n "$(git status --porcelain -- . ':(exclude)bench/results')" ] && TRACE_REPLAY_COMMIT+="-dirty"
  export TRACE_REPLAY_COMMIT
fi
if ls .whl/*.whl >/dev/null 2>&1; then  # carried pure-Python wheels (benchmarks only)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
san() {  # san <tool> <log name> <pytest args...>: one compute-sanitizer run of GPU tests (kernel errors
         # only), at most SANITIZER_S seconds (0 or unset: no limit)
  local tool="$1" name="$2"; shift 2
  timeout -k 5 "${SANITIZER_S:-0}" compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
    --report-api-errors no python3 -m pytest "$@" -m gpu -q -p no:cacheprovider > "$OUT/sanitizer_${name}.log" 2>&1
  local rc=$?
  echo "compute-sanitizer --tool $tool ($name): exit $rc"; grep -E "passed|failed|SUMMARY" "$OUT/sanitizer_${name}.log" | tail -n 3
  [ $rc -eq 0 ] || status=1
}
san_logprob() {  # memcheck and racecheck over the logprob GPU tests (the two largest vocabularies skipped)
  for tool in memcheck racecheck; do
    san "$tool" "${tool}_logprob" tests/test_gpu_logprob_rank.py -k "not 262144 and not 151936"
  done
}
# Three torch calls of the logprob op (bf16, vocabulary 151,936; batch and top_k from argv), the
# workload the profile parts record (they skip the first launches: compilation and warm-up).
LOGPROB_CALLS='import sys, torch
from trace_replay_torch import token_logprob_rank
b, k = int(sys.argv[1]), int(sys.argv[2])
x = (torch.randn(b, 151936, device="cuda") * 4).bfloat16()
ids = torch.randint(0, 151936, (b,), device="cuda")
for _ in range(3):
    token_logprob_rank(x, ids, top_k=k)
torch.cuda.synchronize()'
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench-launch)
status=0
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit ${TRACE_REPLAY_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton, jax, numpy, cuda.bindings, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "jax", jax.__version__, "numpy", numpy.__version__, "cuda-bindings", cuda.bindings.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$OUT/env.txt"
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      python3 -m pytest tests -m gpu -q -rfEs -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
    tests-parallel)
      # The same tier on several pytest workers (pytest-xdist, tests spread one by one) sharing the GPU;
      # the two tests that read the device's free memory run alone afterwards.
      alone=(tests/test_gpu_reliability.py::test_create_close_cycles_do_not_leak
             tests/test_gpu_torch.py::test_close_frees_memory_and_is_idempotent)
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest tests -m gpu -q -rfEs -p no:cacheprovider \
        -n "${GPU_TEST_WORKERS:-12}" --dist load "${alone[@]/#/--deselect=}" \
        --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" || status=1
      python3 -m pytest "${alone[@]}" -m gpu -q -rfEs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_alone.log" \
        || status=1 ;;
    tests-all)
      python3 -m pytest tests -q -rfEs -p no:cacheprovider --junitxml="$OUT/all_tests.xml" 2>&1 | tee "$OUT/all_tests.log" || status=1 ;;
    sanitizer)
      # memcheck and racecheck (kernel errors only) over the replay/staging tier and the logprob
      # tier. Soak and lifetime are shortened: the sanitizer slows every launch a lot. The logprob
      # tier keeps torch's caching allocator (its CUDA-graph test allocates from the graph pool)
      # and skips the two largest vocabularies for time.
      TRACE_REPLAY_SOAK_STEPS=2000 TRACE_REPLAY_LIFETIME_CYCLES=100 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        san memcheck memcheck_replay tests/test_gpu_torch.py tests/test_gpu_reliability.py -k "not without_guard"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 san racecheck racecheck_replay tests/test_gpu_torch.py -k "not without_guard"
      san_logprob ;;
    sanitizer-logprob)
      # memcheck and racecheck over the logprob op's GPU tests alone, each run at most
      # SANITIZER_S seconds (default 150).
      SANITIZER_S="${SANITIZER_S:-150}" san_logprob ;;
    profile-logprob)
      # Hardware counters of the logprob kernels (bf16, vocabulary 151,936: batch 256 and 4096,
      # and batch 256 with top-k 20): speed of light, occupancy, launch, scheduler and warp-state
      # sections; the clocks are left alone.
      for case in "256 0" "4096 0" "256 20"; do
        set -- $case
        name="b$1"; [ "$2" != 0 ] && name="b$1_topk$2"
        ncu --clock-control none -k regex:logprob_rank_ --launch-skip 2 --launch-count 2 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
          --section WarpStateStats \
          python3 -c "$LOGPROB_CALLS" "$1" "$2" > "$OUT/ncu_logprob_$name.txt" 2>&1 || status=1
        grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible" \
          "$OUT/ncu_logprob_$name.txt" | head -n 16
      done ;;
    profile-logprob-source)
      # Warp-state samples per SASS instruction of the chunk kernel (bf16, vocabulary 151,936,
      # batch 256, plain and with top-k 20), as CSV (gzipped) for reading next to the SASS.
      for k in 0 20; do
        ncu --clock-control none -k regex:logprob_rank_chunk --launch-skip 2 --launch-count 1 \
          --section SourceCounters --section WarpStateStats -f -o "/tmp/src_k$k" \
          python3 -c "$LOGPROB_CALLS" 256 "$k" > "$OUT/ncu_src_k$k.log" 2>&1 || status=1
        ncu -i "/tmp/src_k$k.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_src_k$k.csv.gz"
      done ;;
    demo)
      python3 -m trace_replay_app demo --device cuda 2>&1 | tee "$OUT/demo_cuda.log" || status=1 ;;
    cli)
      # Smoke check of the command line on the GPU: a generated trace file and a bf16 checkpoint
      # through `run` (both frameworks) and `compare`, all with --device cuda; outputs in $OUT/cli.
      mkdir -p "$OUT/cli"
      {
        python3 -c 'import sys
from trace_replay_app.checkpoint import save_checkpoint
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
from trace_replay_app.traces import random_requests, write_traces
out = sys.argv[1]
config = GPT2Config()
write_traces(out + "/traces.jsonl", random_requests(config, 128, seed=7, traced=0.75, prompt_len=(1, 48), new_tokens=(1, 64)))
small = GPT2Config(vocab_size=1024, n_positions=64, n_embd=32, n_layer=2, n_head=2)
save_checkpoint(out + "/ckpt", small, seeded_weights(small, 1), dtype="BF16", prefix="transformer.", tied_lm_head=True)
save_checkpoint(out + "/ckpt_sharded", small, seeded_weights(small, 1), dtype="BF16", shards=2)
write_traces(out + "/ckpt_traces.jsonl", random_requests(small, 32, seed=8, traced=0.75, prompt_len=(1, 24), new_tokens=(1, 32)))
print("wrote", out + "/traces.jsonl", "and a checkpoint in", out + "/ckpt")' "$OUT/cli" &&
        for fw in torch jax; do
          python3 -m trace_replay_app run --framework "$fw" --traces "$OUT/cli/traces.jsonl" --device cuda \
            --out "$OUT/cli/run_$fw.json" &&
          python3 -m trace_replay_app run --framework "$fw" --traces "$OUT/cli/ckpt_traces.jsonl" --device cuda \
            --checkpoint "$OUT/cli/ckpt" --out "$OUT/cli/run_ckpt_$fw.json" &&
          python3 -m trace_replay_app run --framework "$fw" --traces "$OUT/cli/ckpt_traces.jsonl" --device cuda \
            --checkpoint "$OUT/cli/ckpt_sharded" --dtype float32 --out "$OUT/cli/run_ckpt_sharded_$fw.json" || exit 1
        done &&
        python3 -m trace_replay_app run --framework torch --traces "$OUT/cli/traces.jsonl" --device cuda \
          --temperature 0.8 --sampling-seed 1 --out "$OUT/cli/run_sampled_torch.json" &&
        python3 -m trace_replay_app compare --traces "$OUT/cli/traces.jsonl" --device cuda --out-dir "$OUT/cli"
      } 2>&1 | tee "$OUT/cli.log" || status=1 ;;
    tune-logprob)
      # The logprob trials of bench/tuning/logprob_tuning.py --mode cluster (knobs of the shipped plan
      # side by side, each checked for invariance and against the shipped bits).
      python3 bench/tuning/logprob_tuning.py --mode cluster 2>&1 | tee "$OUT/tune_groups.log" || status=1 ;;
    bench-core)
      # The three benches whose figures the README quotes most, in this order, each under its own
      # limit (seconds: LOGPROB_S, LAUNCH_S, JAX_STEP_S; the defaults add up to 570).
      for job in "logprob_rank ${LOGPROB_S:-150}" "launch ${LAUNCH_S:-150}" "jax_step ${JAX_STEP_S:-270}"; do
        set -- $job
        start=$SECONDS
        timeout -k 10 "$2" python3 "bench/$1.py" > "$OUT/bench_$1.log" 2>&1
        rc=$?
        echo "bench/$1.py: exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (timed out)")"
        tail -n 3 "$OUT/bench_$1.log"
        [ $rc -eq 0 ] || status=1
      done ;;
    bench-all)
      BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-400}" BENCH_LOG_DIR="$OUT/logs" bash bench/run_all.sh 2>&1 | tee "$OUT/bench_all.log" || status=1 ;;
    bench-*)
      script="bench/${part#bench-}.py"
      script="${script//-/_}"
      python3 "$script" 2>&1 | tee "$OUT/${part}.log" || status=1 ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
done
mkdir -p "$OUT/results" && cp bench/results/* "$OUT/results/" 2>/dev/null || true
# Pack everything into one archive (the caller may fetch only a few files).
if [ -n "${PACK_OUT:-}" ]; then
  tar czf /tmp/gpu_out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_out.tgz "$OUT/"
fi
exit $status
