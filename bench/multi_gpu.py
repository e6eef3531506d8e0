"""Decode speed on 1 and 2 GPUs: the tensor-parallel torch loop (NCCL) and the JAX loop on a 2-device mesh.

Question: replaying traced requests through a Qwen2.5-0.5B-shaped model in bf16, how many
tokens per second does each loop reach on one GPU and split over two: the torch loop
(``torch_loop.run_decode`` on ``cuda:0``; the same with ``tensor_parallel=TensorParallel()`` on 2
ranks, NCCL, one GPU each, vocabulary-parallel head and tensor-parallel attention/MLP, CUDA-graph
step with the collectives inside) and the JAX loop (``jax_loop.run_decode`` on one GPU; the same
with ``mesh=`` a 2-GPU mesh, the logits sharded over the vocabulary)? And do
the 2-GPU runs give the 1-GPU tokens, with logprobs within bf16 tolerance?

Setup: as ``bench/models.py``: a ``qwen2`` model of hidden 896, 24 layers, 14 heads, 2
key/value heads, intermediate 4864, vocabulary 151,936, tied embeddings, random weights made
by transformers (bf16), saved once with ``save_pretrained`` into a temporary folder and read
by every process through the application's checkpoint loader. Per batch ``B`` (default 64 and
256): ``B`` requests (seed 0), prompts of 64-512 tokens, traces of 128-512 random tokens, all
decoding at once (``max_batch=B``).

Method (as ``bench/models.py``): per provider and batch, one warm-up call, one timed call of
the whole decode and one timed call with traces of one token (prefill and fixed costs);
``decode_ms_per_step`` = (whole - prefill) / (steps - 1), ``tokens_per_s`` = ``B`` /
``decode_ms_per_step``. The 2-rank torch run times on rank 0 between barriers.
``max_logprob_diff_vs_1gpu``: the largest |logprob difference| of the 2-GPU run against the
same framework's 1-GPU run; ``tokens_equal_1gpu``: every token equal; ``ranks_agree``: both
torch ranks returned the same bits.

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set in this process's environment before anything starts, so
every child process inherits them.

Run: ``python bench/multi_gpu.py`` on a machine with at least 2 GPUs (exit 2 with a message
otherwise); writes ``bench/results/multi_gpu.json`` and prints a table last. ``--quick``: a
CPU dry run (gloo, 2 processes, a 2-device JAX mesh of CPU host devices, tiny model), writes
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time

# Before torch, JAX or NCCL start, here and in every child process.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPUs with torch
if "--quick" in sys.argv:  # a 2-device mesh of CPU host devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import provenance, table, write_results  # noqa: E402
from qwen_shape import FULL, QUICK, hf_model, prefill_only, traced_requests  # noqa: E402


def _workloads(setup, vocab):
    """Per batch: (batch, requests, the same requests with one-token traces)."""
    out = []
    for batch in setup["batches"]:
        requests = traced_requests(np.random.default_rng(0), batch, setup["prompt"], setup["trace"], vocab)
        out.append((batch, requests, prefill_only(requests)))
    return out


def _time_calls(call, requests, prefill_only, sync):
    """Warm-up, whole call, warm-up and timed prefill-only call: ``(whole_s, prefill_s, results)``."""
    call(requests)
    sync()
    t0 = time.perf_counter()
    results = call(requests)
    sync()
    whole = time.perf_counter() - t0
    call(prefill_only)
    sync()
    t0 = time.perf_counter()
    call(prefill_only)
    sync()
    return whole, time.perf_counter() - t0, results


def _make_model(setup, folder, on_gpu):
    """Save the Qwen2.5-0.5B-shaped random model (transformers, bf16) into ``folder``."""
    import torch

    model, _ = hf_model(setup["sizes"], "cuda" if on_gpu else "cpu")
    model.save_pretrained(folder)
    del model
    if on_gpu:
        torch.cuda.empty_cache()


def _tp_rank(rank, world, folder, work_dir, setup):
    """One rank of the 2-rank torch run: time every batch (rank 0 keeps the times), write results."""
    import torch
    import torch.distributed as dist

    from trace_replay_app.checkpoint import load_checkpoint
    from trace_replay_app.drivers.torch_parallel import TensorParallel
    from trace_replay_app.models.llama.torch_loop import run_decode

    gpu = setup["backend"] == "nccl"
    if gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        setup["backend"], init_method=f"file://{os.path.join(work_dir, 'rendezvous')}", rank=rank, world_size=world
    )
    try:
        _, config, weights = load_checkpoint(folder)
        device = f"cuda:{rank}" if gpu else "cpu"

        def sync():
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()

        out = {}
        for batch, requests, prefill_only in _workloads(setup, config.vocab_size):

            def call(reqs, batch=batch):
                return run_decode(
                    config,
                    weights,
                    reqs,
                    device=device,
                    tensor_parallel=TensorParallel(),
                    max_batch=batch,
                    dtype=setup["dtype"],
                    cuda_graph=setup["cuda_graph"],
                )

            out[batch] = _time_calls(call, requests, prefill_only, sync)
        with open(os.path.join(work_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def _row(provider, gpus, batch, requests, whole, prefill, results, ref=None, **extra):
    steps = max(len(r.trace) for r in requests)
    step_ms = (whole - prefill) / max(1, steps - 1) * 1e3
    row = {
        "provider": provider,
        "gpus": gpus,
        "batch": batch,
        "steps": steps,
        "whole_s": whole,
        "prefill_s": prefill,
        "decode_ms_per_step": step_ms,
        "tokens_per_s": batch / step_ms * 1e3,
        "call_tokens_per_s": sum(len(r.trace) for r in requests) / whole,
        "traces_reproduced": all(res.tokens.tolist() == list(r.trace) for r, res in zip(requests, results)),
    }
    if ref is not None:
        row["tokens_equal_1gpu"] = all(a.tokens.tolist() == b.tokens.tolist() for a, b in zip(results, ref))
        diffs = [np.abs(a.logprobs - b.logprobs).max() for a, b in zip(results, ref)]
        row["max_logprob_diff_vs_1gpu"] = float(max(diffs))
    row.update(extra)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="a CPU dry run: gloo, 2 processes, tiny model (writes nothing)"
    )
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="run both torch loops' decode steps eagerly (default: one CUDA graph per step on a GPU)",
    )
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 64,256; quick 4,8)")
    args = ap.parse_args()
    setup = dict(QUICK if args.quick else FULL)
    # --quick: gloo ranks and float32 on the CPU; else NCCL and bfloat16 on the GPUs
    setup.update(dict(backend="gloo", dtype="float32") if args.quick else dict(backend="nccl", dtype="bfloat16"))
    if args.batches:
        setup["batches"] = tuple(int(b) for b in args.batches.split(","))
    setup["cuda_graph"] = False if args.no_cuda_graph else None
    frameworks = args.frameworks.split(",")

    import torch

    if not args.quick and torch.cuda.device_count() < 2:
        print(
            f"multi_gpu.py needs at least 2 CUDA GPUs (torch sees {torch.cuda.device_count()}); "
            f"run it on a 2-GPU machine, or use --quick for a CPU dry run",
            file=sys.stderr,
        )
        return 2
    import torch.multiprocessing as mp

    from trace_replay_app.checkpoint import load_checkpoint

    if args.quick:
        torch.set_num_threads(1)  # as each CPU rank: one thread per process

    gpu = not args.quick
    device = "cuda:0" if gpu else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="multi_gpu_") as work:
        folder = os.path.join(work, "model")
        t0 = time.perf_counter()
        _make_model(setup, folder, gpu)
        _, config, weights = load_checkpoint(folder)
        print(f"model ready in {time.perf_counter() - t0:.1f} s", flush=True)
        workloads = _workloads(setup, config.vocab_size)

        def sync():
            if gpu:
                torch.cuda.synchronize()

        if "torch" in frameworks:
            from trace_replay_app.models.llama.torch_loop import run_decode

            ref = {}
            for batch, requests, prefill_only in workloads:

                def call(reqs, batch=batch):
                    return run_decode(
                        config,
                        weights,
                        reqs,
                        device=device,
                        max_batch=batch,
                        dtype=setup["dtype"],
                        cuda_graph=setup["cuda_graph"],
                    )

                whole, prefill, ref[batch] = _time_calls(call, requests, prefill_only, sync)
                rows.append(_row("torch", 1, batch, requests, whole, prefill, ref[batch]))
            if gpu:
                torch.cuda.empty_cache()
            mp.start_processes(_tp_rank, args=(2, folder, work, setup), nprocs=2, join=True, start_method="spawn")
            ranks = []
            for r in range(2):
                with open(os.path.join(work, f"rank{r}.pkl"), "rb") as f:
                    ranks.append(pickle.load(f))
            for batch, requests, _ in workloads:
                whole, prefill, results = ranks[0][batch]
                other = ranks[1][batch][2]
                agree = all(
                    a.tokens.tolist() == b.tokens.tolist() and a.logprobs.tobytes() == b.logprobs.tobytes()
                    for a, b in zip(results, other)
                )
                rows.append(
                    _row("torch_tp", 2, batch, requests, whole, prefill, results, ref[batch], ranks_agree=agree)
                )

        if "jax" in frameworks:
            import jax
            from jax.sharding import Mesh

            from trace_replay_app.models.llama.jax_loop import run_decode as jax_run

            devices = jax.devices("gpu" if gpu else "cpu")[:2]
            mesh = Mesh(np.array(devices), ("vocab",))
            for batch, requests, prefill_only in workloads:

                def one(reqs, batch=batch):
                    return jax_run(config, weights, reqs, device=device, max_batch=batch, dtype=setup["dtype"])

                def two(reqs, batch=batch):
                    return jax_run(config, weights, reqs, mesh=mesh, max_batch=batch, dtype=setup["dtype"])

                whole, prefill, ref_jax = _time_calls(one, requests, prefill_only, lambda: None)
                rows.append(_row("jax", 1, batch, requests, whole, prefill, ref_jax))
                whole, prefill, results = _time_calls(two, requests, prefill_only, lambda: None)
                rows.append(_row("jax_mesh", 2, batch, requests, whole, prefill, results, ref_jax))

    for row in rows:  # speed-up of 2 GPUs over 1, same framework and batch
        base = [
            r
            for r in rows
            if r["gpus"] == 1 and r["batch"] == row["batch"] and r["provider"] == row["provider"].split("_")[0]
        ]
        row["x_1gpu_tokens_per_s"] = row["tokens_per_s"] / base[0]["tokens_per_s"] if base else None
    shape = {
        "model": "qwen2 " + json.dumps(setup["sizes"]),
        "dtype": setup["dtype"],
        "prompt_tokens": list(setup["prompt"]),
        "trace_tokens": list(setup["trace"]),
        "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
        "torch_step": "eager" if args.no_cuda_graph or args.quick else "cuda_graph",
    }
    if args.quick:
        json.dumps([dict(r, **shape) for r in rows] + [provenance()])  # the rows serialise; nothing written
        print("quick run: nothing written")
    else:
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print("wrote", write_results("multi_gpu", [dict(r, **shape, visible_gpus=gpus) for r in rows]))
    print(
        table(
            rows,
            [
                "provider",
                "gpus",
                "batch",
                "tokens_per_s",
                "decode_ms_per_step",
                "call_tokens_per_s",
                "x_1gpu_tokens_per_s",
                "traces_reproduced",
                "tokens_equal_1gpu",
                "max_logprob_diff_vs_1gpu",
                "ranks_agree",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
