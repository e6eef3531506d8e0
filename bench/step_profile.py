"""Where does a decode step's time go? The shipped Llama-family steps, kernel by kernel.

Question (issue #42): the torch and JAX decode steps at the Qwen2.5-0.5B shape run several times
the memory floor; which kernels take the time? Per framework and batch (``--batches``, default
64 and 256), bf16, a KV cache of 1,024 positions per row with each row's length drawn from
204-1,024 (as ``bench/tuning/decode_attention.py``), one decode step of the family's model
alone (no replay, no logprob) as it ships on a GPU: torch ``LlamaTorch`` (the fused form)
captured in a CUDA graph and replayed; JAX the family's ``decode`` with ``attention_for``'s
choice (cuDNN), jitted with the cache donated. After warm-up, ``--steps`` steps are profiled
(``torch.profiler`` with CUDA activity; ``jax.profiler.trace``, read back with
``jax.profiler.ProfileData``) and the device's kernels are grouped by a short name: per group
the launches per step and the device time per step (us), largest first, then the kernels per
step and their total. Prints JSON lines; ``--write`` also writes ``results/step_profile.json``
(every row, with its provenance).

``--quick``: a CPU dry run on a tiny Llama config (JAX on the CPU has no device kernels: the
rows show the host's XLA ops instead, which checks the reading of the trace).

Run: ``python bench/step_profile.py [--frameworks torch,jax] [--batches 64,256]`` on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen_shape import FULL, QWEN2_OPTIONS  # noqa: E402

from trace_replay_app.models.llama.config import LlamaConfig, default_config, seeded_weights  # noqa: E402

KV_LEN = 1024


def short(name: str) -> str:
    """A kernel's group: its name without template arguments, launch ids and trailing numbers."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"(_\d+)+$", "", name)
    return name[:80]


def table(events: list[tuple[str, float]], steps: int, framework: str, batch: int) -> list[dict]:
    """Rows of ``(kernel name, device us)`` events grouped by :func:`short`, per step."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in events:
        groups[short(name)].append(us)
    order = sorted(groups, key=lambda k: -sum(groups[k]))
    rows = [
        dict(
            framework=framework,
            batch=batch,
            kernel=k,
            per_step=len(groups[k]) / steps,
            us_per_step=sum(groups[k]) / steps,
        )
        for k in order
    ]
    total = dict(
        framework=framework,
        batch=batch,
        kernel="(all)",
        per_step=sum(len(v) for v in groups.values()) / steps,
        us_per_step=sum(sum(v) for v in groups.values()) / steps,
    )
    return [total] + rows


def _inputs(config, batch: int):
    """Tokens, positions (lengths drawn as decode_attention.py draws them, minus 1) and the
    generator the cache's values come from next."""
    rng = np.random.default_rng(batch)
    lengths = rng.integers(KV_LEN // 5, KV_LEN + 1, batch)
    return rng.integers(0, config.vocab_size, batch), lengths - 1, rng


def torch_events(config, weights, batch: int, steps: int, device: str) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trace_replay_app.models.llama.torch_loop import LlamaTorch

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = LlamaTorch(config, weights, dev, dtype)
    tokens, positions, rng = _inputs(config, batch)
    cache = model.new_cache(batch, KV_LEN)
    cache.copy_(torch.from_numpy(0.5 * rng.standard_normal(cache.shape).astype(np.float32)).to(dtype))
    t, p = torch.as_tensor(tokens, device=dev), torch.as_tensor(positions, device=dev)
    with torch.no_grad():
        for _ in range(2):
            model.decode(cache, t, p)
        if dev.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.decode(cache, t, p)
            run = graph.replay
        else:
            run = lambda: model.decode(cache, t, p)  # noqa: E731
        run()
        activities = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(steps):
                run()
            if dev.type == "cuda":
                torch.cuda.synchronize()
    kind = "cuda" if dev.type == "cuda" else "cpu"
    return [
        (e.name, e.device_time if kind == "cuda" else e.cpu_time)
        for e in prof.events()
        if e.device_type.name.lower() == kind and (kind == "cuda" or e.name.startswith("aten::"))
    ]


def jax_events(config, weights, batch: int, steps: int) -> list[tuple[str, float]]:
    import jax
    import jax.numpy as jnp

    from trace_replay_app.drivers.jax_attention import attention_for
    from trace_replay_app.drivers.jax_placement import device_params
    from trace_replay_app.models.llama.jax_loop import JAX

    dev = jax.devices()[0]
    dtype = jnp.bfloat16 if dev.platform == "gpu" else jnp.float32
    attention = attention_for(dev, dtype)
    params = device_params(JAX, config, weights, dev, dtype)
    tokens, positions, rng = _inputs(config, batch)
    cache = JAX.new_cache(config, batch, KV_LEN, dtype)
    cache = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), dtype), cache)
    t, p = jax.device_put(tokens.astype(np.int32), dev), jax.device_put(positions.astype(np.int32), dev)
    step = jax.jit(lambda prm, c, tk, ps: JAX.decode(prm, config, c, tk, ps, attention), donate_argnums=1)
    for _ in range(3):
        _, cache = step(params, cache, t, p)
    jax.block_until_ready(cache)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                _, cache = step(params, cache, t, p)
            jax.block_until_ready(cache)
        paths = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.endswith(".xplane.pb")]
        data = jax.profiler.ProfileData.from_file(paths[0])
    events, lines = [], set()
    gpu = [pl for pl in data.planes if pl.name.startswith("/device:GPU")]
    for plane in gpu or [pl for pl in data.planes if pl.name.startswith("/host:CPU")]:
        for line in plane.lines:
            lines.add(f"{plane.name}: {line.name}")
            if gpu and not line.name.startswith("Stream"):
                continue  # the device's kernels are on its stream lines
            if not gpu and "XLA Ops" not in line.name and "tf_XLA" not in line.name:
                continue
            events += [(e.name, e.duration_ns / 1e3) for e in line.events]
    print(json.dumps({"framework": "jax", "batch": batch, "trace_lines": sorted(lines)[:40]}), flush=True)
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="a CPU dry run on a tiny config")
    ap.add_argument("--write", action="store_true", help="write results/step_profile.json (with provenance)")
    args = ap.parse_args()
    if args.quick:
        config = default_config("qwen2")
        batches, steps = [4], 2
    else:
        config = LlamaConfig(model_type="qwen2", qkv_bias=True, **FULL["sizes"], **QWEN2_OPTIONS)
        batches, steps = [int(b) for b in args.batches.split(",")], args.steps
    weights = seeded_weights(config)
    out = []
    for framework in args.frameworks.split(","):
        for batch in batches:
            if framework == "torch":
                events = torch_events(config, weights, batch, steps, "cpu" if args.quick else "cuda")
            else:
                events = jax_events(config, weights, batch, steps)
            rows = table(events, steps, framework, batch)
            for row in rows[: args.top + 1]:
                print(json.dumps(row), flush=True)
            out += rows
    if args.write and not args.quick:
        from harness import write_results

        print(f"wrote {write_results('step_profile', out)}")


if __name__ == "__main__":
    main()
