"""Rank bodies of the multi-process tests (``test_multi_device.py``, ``test_gpu_multi.py``).

Kept apart from the test modules so that a spawned rank imports torch and the application
only (no pytest, no transformers). A job file (pickle) lists tensor-parallel runs of the torch
driver (the ``run_decode`` of the config's family with ``tensor_parallel=TensorParallel()``):
``(name, config, weights, requests, options)``; each rank writes ``{name: results}`` to
``<out_dir>/rank<r>.pkl``.
"""

from __future__ import annotations

import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast off for every NCCL user (a program using it can take a host's shared GPUs
# out of service): set in each rank's own environment before its process group starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def tp_rank(rank: int, world: int, init_file: str, jobs_file: str, out_dir: str, backend: str) -> None:
    """One rank: join the group (``backend`` gloo on the CPU, nccl on ``cuda:<rank>``), run
    every job, write this rank's results."""
    os.environ.update(NO_MULTICAST)  # this rank's process only
    torch.set_num_threads(1)  # CI has two cores: one per rank
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from trace_replay_app.drivers.torch_parallel import TensorParallel
        from trace_replay_app.models import family_for_config

        with open(jobs_file, "rb") as f:
            jobs = pickle.load(f)
        out = {}
        for name, config, weights, requests, options in jobs:
            options = dict(options)
            tp = TensorParallel(layers=options.pop("tp_layers", None))
            run_decode = family_for_config(config).run_decode("torch")
            out[name] = run_decode(config, weights, requests, device=device, tensor_parallel=tp, **options)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def run_ranks(jobs, tmp_dir: str, *, world: int = 2, backend: str = "gloo", timeout_s: float = 300):
    """Run ``jobs`` on ``world`` spawned ranks; return each rank's ``{name: results}``, in rank order.

    Raises ``RuntimeError`` (with the ranks' exit) when a rank fails or the ranks outlive
    ``timeout_s`` (then they are terminated).
    """
    jobs_file = os.path.join(tmp_dir, "jobs.pkl")
    with open(jobs_file, "wb") as f:
        pickle.dump(list(jobs), f)
    init_file = os.path.join(tmp_dir, "rendezvous")
    ctx = mp.start_processes(
        tp_rank, args=(world, init_file, jobs_file, tmp_dir, backend), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise RuntimeError(f"the {world} ranks did not finish within {timeout_s} s")
    out = []
    for r in range(world):
        with open(os.path.join(tmp_dir, f"rank{r}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out
