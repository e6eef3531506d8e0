"""Table placement: device memory vs host-mapped pinned memory, per replay step and in memory.

Question: what does keeping the trace table in pinned host memory (mapped into the GPU's address
space) instead of GPU memory cost per decode step, at batch 1 to 4096 and with traces of 1K to
128K tokens; and how much memory of each kind does each placement use?

Setup: for each trace length L in (1024, 8192, 32768, 131072) and each placement, one
``TraceReplayState`` of ``max_slots`` x L with every slot holding a full trace of L random
tokens. ``max_slots`` is 4096 for L <= 8192 and ``2**27 / L`` above (1024 at 32K, 256 at 128K),
so no table exceeds 128 MiB (16 MiB at 1K). Rows use the per-row step form
(``replay_at_step``): row ``b`` reads ``table[idx[b], step[b]]`` with random slots and random
steps in ``[0, L)``, so rows read distinct table cells even when the batch exceeds
``max_slots`` (then several rows share a slot, as no real loop would, but each reads its own
cell). 16 input sets (sampled, idx, step) are prebuilt per batch size and used in turn.

Providers, per (L, placement, batch):

- ``kernel_device``: device time of one replay kernel, CUDA events via
  ``triton.testing.do_bench`` (which flushes the L2 cache before each call) of a
  ``BoundReplay`` (``table.bind_replay(sampled, idx, step=step)``), rotating among the 16 sets.
- ``torch_adapter_host``: host time per step of ``TraceReplayState.replay_at_step`` over
  back-to-back calls (:func:`harness.time_host`, 500 calls x 10 rounds), rotating among the 16
  sets; when the kernel is slower than the launch, this shows the kernel's throughput.
- ``event_floor``: ``do_bench`` of an empty call: what two adjacent events read with no work
  between them (subtract it mentally from small ``kernel_device`` figures).

Memory, per (L, placement): table bytes (``4 x max_slots x L``; GPU memory for ``device``, pinned
host memory for ``host_mapped``), trace lengths (``4 x max_slots`` bytes of GPU memory), staging
(the adapter's default ring: 4 pairs of 1 MiB pinned host + 1 MiB device; the fill commits at
most 1 MiB at a time so the ring never grows), and the GPU memory actually taken, measured as
the drop in free device memory (``cudaMemGetInfo``, 2 MiB granularity) across construction
and fill.

Does not measure: the step-from-lengths form (``replay``: two more gathers per row from small
per-slot arrays; see ``scaling.py``), commits (``staging.py``), PCIe contention from other
traffic during a real decode step (host-mapped reads share the link with everything else).
Run: ``python bench/placement.py`` on a GPU; writes ``bench/results/placement.json``.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_args, provenance, rotating, table, time_cuda, time_host, write_results  # noqa: E402

TRACE_LENS = (1024, 8192, 32768, 131072)
BATCHES = (1, 4, 16, 64, 256, 1024, 4096)
PLACEMENTS = ("device", "host_mapped")
TABLE_TOKENS = 1 << 25  # 128 MiB of int32 per table at most
MAX_SLOTS_CAP = 4096
SETS = 16
VOCAB = 150_000
STAGING_DEPTH = 4  # the adapter's default
STAGING_BYTES = 1 << 20  # TraceTable's default initial staging buffer
FILL_BYTES = STAGING_BYTES - (64 << 10)  # payload per fill commit: fits the default staging buffer
BENCH_MS = dict(warmup_ms=25, rep_ms=100)
HOST_CALLS = dict(calls=500, rounds=10, warmup=100)


def max_slots_for(length: int) -> int:
    return min(MAX_SLOTS_CAP, TABLE_TOKENS // length)


def main() -> None:
    parse_args(__doc__)
    import torch

    from trace_replay_torch import TraceReplayState

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize
    rng = np.random.default_rng(0)
    pool = rng.integers(1, VOCAB, size=TABLE_TOKENS, dtype=np.int32)
    rows = []

    # Load every kernel once, so that module loading does not show in the memory figures.
    with TraceReplayState(8, 8, device=dev, placement="device") as warm:
        warm.add_request(0, [1, 2, 3])
        warm.apply_staged_writes()
        s = torch.zeros(4, dtype=torch.int64, device=dev)
        z = torch.zeros(4, dtype=torch.int32, device=dev)
        warm.replay_at_step(s, z, z)
        sync()

    stream = torch.cuda.current_stream(dev).cuda_stream
    floor = time_cuda(lambda: None, **BENCH_MS)
    rows.append(
        dict(
            kind="timing",
            provider="event_floor",
            placement=None,
            trace_tokens=None,
            batch=None,
            max_slots=None,
            **floor,
        )
    )
    print(f"event floor (do_bench of an empty call): p50 {floor['us_p50']:.2f} us", flush=True)

    for length in TRACE_LENS:
        max_slots = max_slots_for(length)
        traces = pool[: max_slots * length].reshape(max_slots, length)
        per_commit = max(1, FILL_BYTES // (length * 4))
        for placement in PLACEMENTS:
            sync()
            free_before = torch.cuda.mem_get_info(dev)[0]
            st = TraceReplayState(max_slots, length, device=dev, placement=placement)
            for first in range(0, max_slots, per_commit):
                for slot in range(first, min(first + per_commit, max_slots)):
                    st.add_request(slot, traces[slot])
                st.apply_staged_writes()
            sync()
            gpu_taken = free_before - torch.cuda.mem_get_info(dev)[0]
            table_bytes = 4 * max_slots * length
            staging = STAGING_DEPTH * STAGING_BYTES
            mem = dict(
                kind="memory",
                placement=placement,
                trace_tokens=length,
                max_slots=max_slots,
                table_bytes=table_bytes,
                table_memory="gpu" if placement == "device" else "pinned_host",
                trace_len_bytes=4 * max_slots,
                staging_pinned_host_bytes=staging,
                staging_device_bytes=staging,
                gpu_bytes_formula=(table_bytes if placement == "device" else 0) + 4 * max_slots + staging,
                pinned_host_bytes_formula=(table_bytes if placement == "host_mapped" else 0) + staging,
                gpu_bytes_measured=int(gpu_taken),
            )
            rows.append(mem)
            print(
                f"L={length:6d} slots={max_slots:5d} {placement:11s} table {table_bytes / 2**20:7.1f} MiB "
                f"({mem['table_memory']}), GPU taken (measured) {gpu_taken / 2**20:7.1f} MiB",
                flush=True,
            )

            for batch in BATCHES:
                sets = []
                for _ in range(SETS):
                    slots = np.concatenate([rng.permutation(max_slots) for _ in range(-(-batch // max_slots))])[:batch]
                    sampled = torch.tensor(rng.integers(0, VOCAB, batch), dtype=torch.int64, device=dev)
                    idx = torch.tensor(slots, dtype=torch.int32, device=dev)
                    step = torch.tensor(rng.integers(0, length, batch), dtype=torch.int32, device=dev)
                    sets.append((sampled, idx, step))
                bounds = [
                    functools.partial(st.table.bind_replay(s, i, step=k, stream=stream), stream=stream)
                    for s, i, k in sets
                ]
                kernel = time_cuda(rotating(bounds), **BENCH_MS)
                adapter = time_host(
                    rotating([functools.partial(st.replay_at_step, s, i, k) for s, i, k in sets]),
                    sync=sync,
                    **HOST_CALLS,
                )
                for provider, stats in (("kernel_device", kernel), ("torch_adapter_host", adapter)):
                    rows.append(
                        dict(
                            kind="timing",
                            provider=provider,
                            placement=placement,
                            trace_tokens=length,
                            batch=batch,
                            max_slots=max_slots,
                            **stats,
                        )
                    )
                print(
                    f"L={length:6d} {placement:11s} B={batch:5d} kernel {kernel['us_p50']:8.2f} us "
                    f"(p20 {kernel['us_p20']:.2f}, p80 {kernel['us_p80']:.2f}), adapter host "
                    f"{adapter['us_p50']:8.2f} us",
                    flush=True,
                )
                del bounds, sets
            sync()
            st.close()

    path = write_results("placement", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    timing = [r for r in rows if r["kind"] == "timing" and r["provider"] != "event_floor"]
    by_key = {(r["trace_tokens"], r["batch"], r["placement"], r["provider"]): r for r in timing}
    side = []
    for length in TRACE_LENS:
        for batch in BATCHES:
            d = by_key[(length, batch, "device", "kernel_device")]["us_p50"]
            h = by_key[(length, batch, "host_mapped", "kernel_device")]["us_p50"]
            side.append(
                dict(
                    trace_tokens=length,
                    batch=batch,
                    device_kernel_us=d,
                    host_mapped_kernel_us=h,
                    host_mapped_over_device=h / d,
                    device_adapter_us=by_key[(length, batch, "device", "torch_adapter_host")]["us_p50"],
                    host_mapped_adapter_us=by_key[(length, batch, "host_mapped", "torch_adapter_host")]["us_p50"],
                )
            )
    print(
        table(
            side,
            [
                "trace_tokens",
                "batch",
                "device_kernel_us",
                "host_mapped_kernel_us",
                "host_mapped_over_device",
                "device_adapter_us",
                "host_mapped_adapter_us",
            ],
        )
    )
    print()
    print(
        table(
            [r for r in rows if r["kind"] == "memory"],
            [
                "trace_tokens",
                "max_slots",
                "placement",
                "table_bytes",
                "table_memory",
                "gpu_bytes_formula",
                "gpu_bytes_measured",
                "pinned_host_bytes_formula",
            ],
        )
    )


if __name__ == "__main__":
    main()
