"""Does a change move the host cost of a decode step's calls? Two source trees, side by side.

Question: for the calls a decode loop makes every step through the torch adapter (a replay with
bound lengths, and ``token_logprob_rank`` of bf16 logits, with its outputs allocated per call and given as ``out=``),
is the host time per call of one
source tree within a few percent of another's, on the same machine in the same run?

Method: one child process per (tree, round), the trees alternating (A B A B ...), each child
importing the library from its tree (``PYTHONPATH``), then timing ``CALLS`` back-to-back calls
per repetition after a warm-up (no synchronisation inside a repetition, so a call whose device
work exceeds its host work shows device time) and reporting the median repetition in us per call.
Alternating processes cancels the drift of a shared host; the ratio B / A of the medians over
rounds is the answer. Setup as ``bench/launch.py``'s replay (1024 slots, 8192 tokens per slot,
every slot traced) and ``bench/logprob_rank.py``'s vocabulary (151,936).

Run on a GPU: ``python bench/tuning/trees.py --trees OLD_ROOT NEW_ROOT [--rounds 3]``; writes
``bench/results/tuning_trees.json``. ``--device cpu`` runs the same plumbing on the CPU backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import provenance, write_results  # noqa: E402

CALLS = 2000
REPS = 7
CHILD = r"""
import json, sys, time
import numpy as np, torch
from trace_replay_torch import TraceReplayState, token_logprob_rank
device, calls, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
def per_call(fn):
    fn(); sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(out))
rng = np.random.default_rng(0)
slots, length = 1024, 8192
prompt = torch.tensor(rng.integers(0, 64, slots), dtype=torch.int32, device=device)
total = prompt + torch.tensor(rng.integers(0, length, slots), dtype=torch.int32, device=device)
state = TraceReplayState(slots, length, device=device, total_len=total, prompt_len=prompt)
traces = rng.integers(0, 32000, (slots, length))
state.add_requests(list(range(slots)), traces)
state.apply_staged_writes()
rows = {}
for batch in (1, 256):
    idx = torch.tensor(rng.permutation(slots)[:batch], dtype=torch.int32, device=device)
    sampled = torch.zeros(batch, dtype=torch.int64, device=device)
    rows[f"replay_b{batch}"] = per_call(lambda: state.replay(sampled, idx))
    logits = (torch.randn(batch, 151936, device=device) * 4).to(torch.bfloat16)
    ids = torch.randint(0, 151936, (batch,), device=device)
    if device == "cuda":
        rows[f"logprob_b{batch}"] = per_call(lambda: token_logprob_rank(logits, ids))
        out = (torch.empty(batch, device=device), torch.empty(batch, dtype=torch.int64, device=device))
        rows[f"logprob_out_b{batch}"] = per_call(lambda: token_logprob_rank(logits, ids, out=out))
state.close()
print(json.dumps(rows))
"""


def run_child(tree: str, device: str, calls: int, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "adapters")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, device, str(calls), str(reps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tree,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child for {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"), help="two source tree roots")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--calls", type=int, default=CALLS)
    args = ap.parse_args()
    seen: dict[str, dict[str, list[float]]] = {t: {} for t in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            for name, us in run_child(os.path.abspath(tree), args.device, args.calls, REPS).items():
                seen[tree].setdefault(name, []).append(us)
    a, b = args.trees
    rows = []
    for name in seen[a]:
        ma, mb = statistics.median(seen[a][name]), statistics.median(seen[b][name])
        rows.append(
            {
                "call": name,
                "us_a": ma,
                "us_b": mb,
                "ratio_b_over_a": mb / ma,
                "rounds_a": seen[a][name],
                "rounds_b": seen[b][name],
            }
        )
        print(f"{name:14s} A {ma:8.2f} us  B {mb:8.2f} us  B/A {mb / ma:6.3f}   (A {a}, B {b})")
    if args.device == "cuda":
        write_results("tuning_trees", [dict(r, trees=[a, b]) for r in rows])
    else:
        print(json.dumps(provenance(), default=str)[:200])


if __name__ == "__main__":
    main()
