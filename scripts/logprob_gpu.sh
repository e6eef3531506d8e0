#!/usr/bin/env bash
# The logprob op on a CUDA GPU in one go, each stage under its own time limit: a compile-and-check
# smoke run, bench/logprob_rank.py, bench/tuning/logprob_tuning.py, the GPU tests of the op. Logs and
# results go to $OUT (default ./gpu-out). Uses the packages already installed there. Stage limits
# (seconds): SMOKE_S, BENCH_S, TUNING_S, TESTS_S, REST_S (defaults add up to under 600).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/results"
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stage() {  # stage <name> <seconds> <command...>
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  tail -n 4 "$OUT/$name.log"
}
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton, jax; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "jax", jax.__version__)'
} > "$OUT/env.txt" 2>&1
stage smoke "${SMOKE_S:-60}" python3 - <<'EOF'
import time, torch
from trace_replay_torch import token_logprob_rank
for dtype in (torch.bfloat16, torch.float32, torch.float16):
    for batch, vocab, k in ((3, 151936, 0), (3, 151936, 20), (2, 1000, 5), (2, 9000, 64), (2, 5000, 1)):
        t0 = time.time()
        x = (torch.randn(batch, vocab, device="cuda") * 4).to(dtype)
        ids = torch.randint(0, vocab, (batch,), device="cuda")
        try:
            r = token_logprob_rank(x, ids, top_k=k, temperature=torch.full((batch,), 0.7, device="cuda"))
            ref = torch.log_softmax(x.float() / 0.7, -1)
            err = float((r.logprobs - ref.gather(1, ids[:, None])[:, 0]).abs().max())
            msg = f"max |dlogprob| {err:.2e}"
            if k:
                tv, ti = ref.topk(k, dim=-1)
                msg += f" top-k ids equal {bool(torch.equal(ti, r.topk_ids))} max |dtop| {float((tv - r.topk_logprobs).abs().max()):.2e}"
        except Exception as exc:
            msg = f"FAILED {type(exc).__name__}: {exc}"
        print(dtype, batch, vocab, k, f"{time.time() - t0:.1f} s", msg, flush=True)
EOF
stage bench_logprob_rank "${BENCH_S:-120}" python3 bench/logprob_rank.py
stage bench_logprob_tuning "${TUNING_S:-90}" python3 bench/tuning/logprob_tuning.py --mode split
stage tests_topk "${TESTS_S:-200}" python3 -m pytest tests/test_gpu_logprob_topk.py -m gpu -q -rfEs -p no:cacheprovider -x
stage tests_rest "${REST_S:-120}" python3 -m pytest tests/test_gpu_logprob_rank.py tests/test_jax_logprob.py -m gpu -q -rfEs \
  -p no:cacheprovider -k "not 262144 and not b1024-v151936"
cp bench/results/logprob_*.json "$OUT/results/" 2>/dev/null || true
