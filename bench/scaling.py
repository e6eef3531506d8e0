"""Scaling: replay cost per step from batch 1 to 4096, per path and placement.

Question: how does the cost of one replay step grow with the batch, through each way of running
it; from which batch on does the kernel itself, rather than launching it, set the cost; and how
close is the kernel then to the time it must take just to move its bytes?

Setup: 4096 slots x 8192 tokens per slot (128 MiB table), every slot traced with a random
length in [1, 8192]; per-slot ``prompt_len`` random, ``total_len`` = prompt + an offset in
[-2, 8194), so rows land before, inside and past their traces. Batch in (1, 4, ..., 4096); rows
map to distinct slots. The step comes from the lengths (``replay``, the common form). Both
placements (``device``, ``host_mapped``). 16 input sets (sampled int64, idx_mapping int32, and
for the kernel timing its own ``total_len``) are prebuilt per batch and used in turn, so that
successive launches touch different table cells.

Providers, per (placement, batch):

- ``torch_eager``: host time per step of ``TraceReplayState.replay(sampled, idx_mapping)``
  (lengths bound), back-to-back calls without synchronisation (:func:`harness.time_host`):
  launch cost while the device keeps up, kernel throughput once it does not.
- ``torch_cuda_graph``: host time per ``CUDAGraph.replay()`` of a graph holding one
  ``state.replay`` (one graph per batch size and placement), measured the same way.
- ``kernel_device``: device time of one replay kernel, CUDA events via
  ``triton.testing.do_bench`` (L2 flushed before each call), of a ``BoundReplay`` rotating
  among the 16 sets.
- ``event_floor``: ``do_bench`` of an empty call (two adjacent events, no work).
- ``jax_jit``: JAX inside ``jax.jit``: what one replay adds to a step of a compiled
  ``lax.fori_loop`` (``trace_replay_jax.replay`` on the adapter's zero-copy table views),
  next to ``jax_jit_baseline``, the same loop step without replay; see :func:`jax_rows`.

Summary rows:

- ``crossover``: per placement and torch path, the smallest batch whose ``kernel_device`` p50 exceeds
  that path's host time per step at the same batch (``None``: none up to 4096).
- ``floor``: at batch 4096, the memory-traffic floor of the kernel. Bytes it must touch per
  row: idx 4 + trace_len 4 + total_len 4 + prompt_len 4 + one table token 4 + the sampled
  write 8 = 28 B (``dense``); since the four per-slot reads are scattered, each really moves a
  32-byte sector: 4 x 32 + 4 + 8 = 140 B (``sectors``). Floor = bytes / measured bandwidth:
  the device-to-device copy rate (bytes read + written) measured in this run; for
  ``host_mapped`` the table token crosses PCIe instead, at the measured pinned host-to-device
  rate. Reported next to the measured kernel time.

Does not measure: commits (``staging.py``), trace length effects (``placement.py``), the
sampler or the rest of a decode step, several GPUs.
Run: ``python bench/scaling.py`` on a GPU; writes ``bench/results/scaling.json``.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (
    copy_bandwidth,
    parse_args,
    percentiles,
    provenance,
    rotating,
    table,
    time_cuda,
    time_host,
    write_results,
)  # noqa: E402

MAX_SLOTS = 4096
MAX_TRACE_LEN = 8192
BATCHES = (1, 4, 16, 64, 256, 1024, 4096)
PLACEMENTS = ("device", "host_mapped")
PATHS = ("torch_eager", "torch_cuda_graph")
SETS = 16
VOCAB = 150_000
FILL_TOKENS = 200_000  # tokens per fill commit (fits the default 1 MiB staging buffer)
BENCH_MS = dict(warmup_ms=25, rep_ms=100)
HOST_CALLS = dict(calls=1000, rounds=15, warmup=200)
SECTOR = 32
JAX_LOOP_STEPS = 64
JAX_CALLS = 20
JAX_ROUNDS = 11
# bytes per row: (name, bytes, scattered per-slot read)
ROW_BYTES = (
    ("idx_mapping", 4, False),
    ("trace_len", 4, True),
    ("total_len", 4, True),
    ("prompt_len", 4, True),
    ("table token", 4, True),
    ("sampled write", 8, False),
)


def fill_table(state, traces) -> None:
    """Give slot ``i`` the trace ``traces[i]`` through a torch or JAX adapter state, committing
    every ``FILL_TOKENS`` tokens (so each commit fits the default staging buffer)."""
    fill = 0
    for slot, tr in enumerate(traces):
        state.add_request(slot, tr)
        fill += tr.shape[0]
        if fill >= FILL_TOKENS:
            state.apply_staged_writes()
            fill = 0
    state.apply_staged_writes()


def jax_rows(batches, placements, traces, prompt, rng):
    """Rows for JAX inside ``jax.jit``: per (placement, batch), the cost of one replay step in a
    compiled ``lax.fori_loop`` (``provider="jax_jit"``) and the same loop without replay
    (``provider="jax_jit_baseline"``).

    A JAX :class:`trace_replay_jax.TraceReplayState` holds the same traces as the torch rows.
    One jitted call runs ``JAX_LOOP_STEPS`` steps; step ``k`` replays
    ``sampled + k`` for rows mapped to distinct slots at ``total_len + k`` (so every step
    reads other table cells) and folds the result into the carry (so nothing is optimised
    away); the baseline folds ``sampled + k`` unreplayed. Timed by wall clock over
    back-to-back calls, blocking at the end of each round: device time per step when the loop
    is device-bound. ``jax_jit`` reports the loop's time per step minus the baseline's (what
    replay adds to a step in a compiled loop); ``us_total_p50`` keeps the absolute time.
    Returns error rows instead when JAX has no GPU or a placement cannot be viewed by JAX.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    try:
        import jax
        import jax.numpy as jnp

        import trace_replay_jax

        gpu = jax.devices("gpu")[0]
    except Exception as exc:  # noqa: BLE001 - reported as a row: the torch rows still count
        return [dict(kind="error", provider="jax_jit", error=f"{type(exc).__name__}: {exc}")]
    rows = []
    steps = JAX_LOOP_STEPS

    def loop(replay: bool):
        def run(tables, sampled, idx, total_len, prompt_len):
            def body(k, acc):
                tok = sampled + k
                if replay:
                    tok = trace_replay_jax.replay(tables, tok, idx, total_len + k, prompt_len)
                return acc ^ tok

            return jax.lax.fori_loop(0, steps, body, jnp.zeros_like(sampled))

        return jax.jit(run)

    fns = {"jax_jit": loop(True), "jax_jit_baseline": loop(False)}
    prompt_j = jax.device_put(jnp.asarray(prompt, jnp.int32), gpu)
    total_j = jax.device_put(jnp.asarray(prompt + rng.integers(-2, MAX_TRACE_LEN + 2, MAX_SLOTS), jnp.int32), gpu)
    for placement in placements:
        try:
            st = trace_replay_jax.TraceReplayState(MAX_SLOTS, MAX_TRACE_LEN, device=gpu, placement=placement)
        except Exception as exc:  # noqa: BLE001 - e.g. a JAX that cannot view host-mapped memory
            rows.append(
                dict(kind="error", provider="jax_jit", placement=placement, error=f"{type(exc).__name__}: {exc}")
            )
            continue
        fill_table(st, traces)
        for batch in batches:
            sampled = jax.device_put(jnp.asarray(rng.integers(0, VOCAB, batch), jnp.int32), gpu)
            idx = jax.device_put(jnp.asarray(rng.permutation(MAX_SLOTS)[:batch], jnp.int32), gpu)
            per_step = {}
            for provider, fn in fns.items():
                args = (st.tables, sampled, idx, total_j, prompt_j)
                for _ in range(3):
                    jax.block_until_ready(fn(*args))
                per_round = []
                for _ in range(JAX_ROUNDS):
                    t0 = time.perf_counter()
                    out = None
                    for _ in range(JAX_CALLS):
                        out = fn(*args)
                    jax.block_until_ready(out)
                    per_round.append((time.perf_counter() - t0) / (JAX_CALLS * steps) * 1e6)
                per_step[provider] = np.asarray(per_round)
            base = per_step["jax_jit_baseline"]
            rows.append(
                dict(
                    kind="timing",
                    provider="jax_jit_baseline",
                    placement=placement,
                    batch=batch,
                    loop_steps=steps,
                    **percentiles(base),
                )
            )
            added = percentiles(per_step["jax_jit"] - np.median(base))
            rows.append(
                dict(
                    kind="timing",
                    provider="jax_jit",
                    placement=placement,
                    batch=batch,
                    loop_steps=steps,
                    us_total_p50=float(np.median(per_step["jax_jit"])),
                    **added,
                )
            )
            print(
                f"{'jax_jit':17s} {placement:11s} B={batch:5d} adds p50 {added['us_p50']:8.2f} us per step "
                f"(loop step {np.median(per_step['jax_jit']):.2f} us, without replay {np.median(base):.2f} us)",
                flush=True,
            )
        st.close()
    return rows


def main() -> None:
    parse_args(__doc__)
    import torch

    from trace_replay_torch import TraceReplayState

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize
    rng = np.random.default_rng(0)
    rows = []

    ceilings = copy_bandwidth()
    for name, c in ceilings.items():
        rows.append(dict(kind="ceiling", ceiling=name, **c))
    d2d = ceilings["d2d"]["gbps_p50"]
    h2d = ceilings["h2d_pinned"]["gbps_p50"]
    print(f"ceilings: d2d {d2d:.1f} GB/s (read + write), pinned h2d {h2d:.1f} GB/s", flush=True)

    lengths = rng.integers(1, MAX_TRACE_LEN + 1, MAX_SLOTS)
    traces = [rng.integers(1, VOCAB, n, dtype=np.int32) for n in lengths]
    prompt = rng.integers(1, 2000, MAX_SLOTS)
    prompt_len = torch.tensor(prompt, dtype=torch.int32, device=dev)
    totals = [
        torch.tensor(prompt + rng.integers(-2, MAX_TRACE_LEN + 2, MAX_SLOTS), dtype=torch.int32, device=dev)
        for _ in range(SETS)
    ]
    total_len = totals[0]
    stream = torch.cuda.current_stream(dev).cuda_stream

    floor_stats = time_cuda(lambda: None, **BENCH_MS)
    rows.append(dict(kind="timing", provider="event_floor", placement=None, batch=None, **floor_stats))
    print(f"event floor (do_bench of an empty call): p50 {floor_stats['us_p50']:.2f} us", flush=True)

    def record(provider, placement, batch, stats):
        rows.append(dict(kind="timing", provider=provider, placement=placement, batch=batch, **stats))
        print(
            f"{provider:17s} {placement:11s} B={batch:5d} p50 {stats['us_p50']:8.2f} us "
            f"(p20 {stats['us_p20']:.2f}, p80 {stats['us_p80']:.2f})",
            flush=True,
        )

    for placement in PLACEMENTS:
        st = TraceReplayState(
            MAX_SLOTS, MAX_TRACE_LEN, device=dev, total_len=total_len, prompt_len=prompt_len, placement=placement
        )
        fill_table(st, traces)
        sync()
        for batch in BATCHES:
            sets = []
            for i in range(SETS):
                sampled = torch.tensor(rng.integers(0, VOCAB, batch), dtype=torch.int64, device=dev)
                idx = torch.tensor(rng.permutation(MAX_SLOTS)[:batch], dtype=torch.int32, device=dev)
                sets.append((sampled, idx, totals[i]))
            record(
                "torch_eager",
                placement,
                batch,
                time_host(rotating([functools.partial(st.replay, s, i) for s, i, _ in sets]), sync=sync, **HOST_CALLS),
            )

            sampled, idx, _ = sets[0]
            st.replay(sampled, idx)  # compiled and bound before capture
            sync()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                with torch.cuda.graph(graph):
                    st.replay(sampled, idx)
            torch.cuda.current_stream(dev).wait_stream(side)
            sync()
            record("torch_cuda_graph", placement, batch, time_host(graph.replay, sync=sync, **HOST_CALLS))
            del graph

            bounds = [
                functools.partial(st.table.bind_replay(s, i, t, prompt_len, stream=stream), stream=stream)
                for s, i, t in sets
            ]
            record("kernel_device", placement, batch, time_cuda(rotating(bounds), **BENCH_MS))
            del bounds, sets
            sync()
        st.close()

    for row in jax_rows(BATCHES, PLACEMENTS, traces, prompt, rng):
        rows.append(row)
        if row["kind"] == "error":
            print(f"jax_jit {row.get('placement', '')}: not measured: {row['error']}", flush=True)

    timing = {(r["provider"], r["placement"], r["batch"]): r for r in rows if r["kind"] == "timing"}
    paths = [p for p in PATHS + ("jax_jit",) if any(k[0] == p for k in timing)]
    for placement in PLACEMENTS:
        for path in PATHS:  # jax_jit launches nothing per step inside its loop: no crossover
            cross = None
            for batch in BATCHES:
                k, h = timing.get(("kernel_device", placement, batch)), timing.get((path, placement, batch))
                if k and h and k["us_p50"] > h["us_p50"]:
                    cross = batch
                    break
            rows.append(dict(kind="crossover", placement=placement, path=path, kernel_dominates_from_batch=cross))
            print(
                f"{placement:11s} {path:17s}: kernel time exceeds host time per step from batch "
                f"{cross if cross is not None else 'none (up to 4096)'}",
                flush=True,
            )

    batch = BATCHES[-1]
    for placement in PLACEMENTS:
        kernel_us = timing[("kernel_device", placement, batch)]["us_p50"]
        for model in ("dense", "sectors"):
            hbm = pcie = 0
            for name, nbytes, scattered in ROW_BYTES:
                moved = SECTOR if (model == "sectors" and scattered) else nbytes
                if placement == "host_mapped" and name == "table token":
                    pcie += moved
                else:
                    hbm += moved
            floor_us = batch * hbm / d2d / 1e3 + batch * pcie / h2d / 1e3
            rows.append(
                dict(
                    kind="floor",
                    placement=placement,
                    batch=batch,
                    model=model,
                    bytes_per_row=hbm + pcie,
                    hbm_bytes=batch * hbm,
                    pcie_bytes=batch * pcie,
                    d2d_gbps=d2d,
                    h2d_gbps=h2d,
                    floor_us=floor_us,
                    floor_ns=floor_us * 1e3,
                    kernel_us_p50=kernel_us,
                    kernel_over_floor=kernel_us / floor_us,
                    kernel_minus_event_floor_us=kernel_us - floor_stats["us_p50"],
                )
            )
            print(
                f"{placement:11s} B={batch} floor ({model}, {hbm + pcie} B/row): {floor_us * 1e3:.1f} ns; "
                f"kernel {kernel_us:.2f} us = {kernel_us / floor_us:.0f}x the floor",
                flush=True,
            )

    path = write_results("scaling", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    side_by_side = []
    for placement in PLACEMENTS:
        for b in BATCHES:
            row = dict(placement=placement, batch=b)
            for p in paths + ["kernel_device"]:
                r = timing.get((p, placement, b))
                row[p] = r["us_p50"] if r else None
            side_by_side.append(row)
    print(table(side_by_side, ["placement", "batch"] + paths + ["kernel_device"]))
    print()
    print(
        table(
            [r for r in rows if r["kind"] == "floor"],
            ["placement", "batch", "model", "bytes_per_row", "floor_ns", "kernel_us_p50", "kernel_over_floor"],
        )
    )


if __name__ == "__main__":
    main()
