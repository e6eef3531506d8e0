"""``trace-replay run`` on the GPU: tokens per second through each framework's reference loop.

Question: how many decoded tokens per second does ``trace-replay run --device cuda`` reach for
the torch and the JAX reference GPT-2 loop, replaying 256 traced requests, at 8 and 64 decode
slots; and how much of a run is the loop rather than reading traces and writing results?

Setup: 256 requests, every one traced with random tokens (prompts of 16-64 tokens, traces of
32-64 tokens; ``trace_replay_app.traces.random_requests``, seed 0), written to a trace
file. Two models: ``tiny``, the seeded default (vocabulary 512, 2 layers, width 64, 128
positions; ``--seed``), and ``small``, a seeded model of vocabulary 16,384, 6 layers, width
512, 8 heads and 256 positions saved as a float32 Hugging Face-layout checkpoint in a temporary
folder (``--checkpoint``).

Method: ``trace_replay_app.cli.main(["run", ...])`` in this process (no subprocess), once
as a warm-up (imports, weights upload, JAX compilation), then ``REPEATS`` timed runs. Per run:
``loop_tokens_per_s`` from the output file's summary (the decode loop call alone: weights
upload, decoding, one copy of the results to the host) and ``end_to_end_tokens_per_s`` (the
whole ``main`` call: reading and checking the trace file, the loop, writing the JSON output).
p20/p50/p80 over the timed runs. Every row records whether every trace was reproduced exactly.

Run: ``python bench/cli_run.py`` on a GPU (``--device cpu`` with fewer ``--requests`` for a
quick check elsewhere); writes ``bench/results/cli_run.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import provenance, table, write_results  # noqa: E402

from trace_replay_app import cli  # noqa: E402
from trace_replay_app.checkpoint import save_checkpoint  # noqa: E402
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights  # noqa: E402
from trace_replay_app.traces import random_requests, write_traces  # noqa: E402

REPEATS = 3
MAX_BATCHES = (8, 64)
MODELS = {
    "tiny": GPT2Config(),
    "small": GPT2Config(vocab_size=16_384, n_positions=256, n_embd=512, n_layer=6, n_head=8),
}


def _pcts(values):
    p20, p50, p80 = np.percentile(np.asarray(values, dtype=np.float64), [20, 50, 80])
    return float(p20), float(p50), float(p80)


def bench_one(framework: str, device: str, traces: str, model_args, out: str, repeats: int):
    """Warm up once, then time ``repeats`` runs; return the per-run summaries and wall times."""
    # float32 compute, as in the committed results (the command line defaults to bfloat16 on a GPU)
    args = [
        "run",
        "--framework",
        framework,
        "--traces",
        traces,
        "--device",
        device,
        "--out",
        out,
        "--quiet",
        "--dtype",
        "float32",
        *model_args,
    ]
    runs = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        status = cli.main(args, out=io.StringIO())
        wall = time.perf_counter() - t0
        with open(out) as f:
            summary = json.load(f)["summary"]
        if i:  # run 0 is the warm-up
            runs.append((summary, wall, status))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--max-batches", default=",".join(map(str, MAX_BATCHES)))
    args = parser.parse_args()
    prov = provenance()
    print(f"{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cli_run_") as tmp:
        for model in args.models.split(","):
            config = MODELS[model]
            prompt_len = (16, 64)
            new_tokens = (32, min(64, config.n_positions - prompt_len[1]))
            requests = random_requests(config, args.requests, seed=0, prompt_len=prompt_len, new_tokens=new_tokens)
            traces = os.path.join(tmp, f"{model}.jsonl")
            write_traces(traces, requests)
            if model == "tiny":
                model_args = ["--seed", "0"]
            else:
                folder = os.path.join(tmp, model)
                save_checkpoint(folder, config, seeded_weights(config, 0))
                model_args = ["--checkpoint", folder]
            tokens = sum(r.new_tokens for r in requests)
            for max_batch in (int(b) for b in args.max_batches.split(",")):
                for framework in cli.FRAMEWORKS:
                    runs = bench_one(
                        framework,
                        args.device,
                        traces,
                        model_args + ["--max-batch", str(max_batch)],
                        os.path.join(tmp, "out.json"),
                        args.repeats,
                    )
                    loop = _pcts([s["tokens_per_s"] for s, _, _ in runs])
                    e2e = _pcts([tokens / wall for _, wall, _ in runs])
                    exact = all(
                        s["exact_reproductions"] == s["traced_requests"] == len(requests) and status == 0
                        for s, _, status in runs
                    )
                    row = {
                        "framework": framework,
                        "model": model,
                        "device": args.device,
                        "max_batch": max_batch,
                        "requests": len(requests),
                        "tokens": tokens,
                        "repeats": len(runs),
                        "loop_tokens_per_s_p20": loop[0],
                        "loop_tokens_per_s_p50": loop[1],
                        "loop_tokens_per_s_p80": loop[2],
                        "end_to_end_tokens_per_s_p20": e2e[0],
                        "end_to_end_tokens_per_s_p50": e2e[1],
                        "end_to_end_tokens_per_s_p80": e2e[2],
                        "loop_seconds_p50": float(np.median([s["seconds"] for s, _, _ in runs])),
                        "all_traces_reproduced": exact,
                        "config": dataclasses.asdict(config),
                    }
                    rows.append(row)
                    print(
                        f"{framework:5s} {model:5s} max_batch {max_batch:3d}: loop {loop[1]:9.0f} tokens/s, "
                        f"end to end {e2e[1]:9.0f} tokens/s, reproduced {exact}",
                        flush=True,
                    )
    path = write_results("cli_run", rows)
    print(f"\nwrote {path}\n")
    print(
        table(
            rows,
            [
                "framework",
                "model",
                "max_batch",
                "tokens",
                "loop_tokens_per_s_p50",
                "end_to_end_tokens_per_s_p50",
                "all_traces_reproduced",
            ],
        )
    )


if __name__ == "__main__":
    main()
