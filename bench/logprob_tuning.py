"""Which block size and warp count for the logprob-and-rank kernel?

Question: the kernel reads ``BLOCK`` logits per loop iteration with ``num_warps`` warps per
program (``trace_replay_core.kernels.logprob_rank.LOGPROB_BLOCK`` / ``LOGPROB_NUM_WARPS``).
Which pair reads the logits fastest at vocab 151,936, for bfloat16 and float32 logits, at the
batch sizes where one program owns a row (256, 1024) and where rows are split (64)?

Method: each variant is bound through the core (``bind_logprob_rank``) with the module
constants set to it while binding (compiled once per variant), and timed with
``harness.time_cuda_queued`` (calls queued behind a busy kernel, host cost hidden) on copies of
the logits rotated so that L2 does not serve them (256 MiB in all, at most 32 copies). Before
timing, every variant's result is compared with the shipped setting's (ranks equal, largest
logprob difference). Reported: p20/p50/p80 in us and GB/s of logits read, next to the
device-to-device copy bandwidth (bytes read + written) measured in the same run.

Does not measure: host cost (``logprob_rank.py``), other vocabularies, other GPUs.
Run: ``python bench/logprob_tuning.py`` on a GPU; writes ``bench/results/logprob_tuning.json``.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (bandwidth, copy_bandwidth, provenance, rotating, table, time_cuda_queued,  # noqa: E402
                     write_results)

VOCAB = 151_936
BATCHES = (64, 256, 1024)
DTYPES = ("bfloat16", "float32")
VARIANTS = ((4096, 16), (4096, 8), (8192, 8), (8192, 16), (4096, 4), (2048, 4), (16384, 16))   # shipped first
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32


def bind_variant(block, warps, logits, ids, out, workspace, stream):
    """A bound core call compiled and planned with ``BLOCK = block`` and ``num_warps = warps``."""
    import trace_replay_core.kernels.logprob_rank as kernels
    import trace_replay_core._logprob as core
    saved = kernels.LOGPROB_BLOCK, kernels.LOGPROB_NUM_WARPS
    kernels.LOGPROB_BLOCK, kernels.LOGPROB_NUM_WARPS = block, warps
    try:
        return core.bind_logprob_rank(logits, ids, out_logprobs=out[0], out_ranks=out[1], stream=stream,
                                      workspace=workspace)
    finally:
        kernels.LOGPROB_BLOCK, kernels.LOGPROB_NUM_WARPS = saved


def main() -> None:
    import torch

    import trace_replay_core.kernels.logprob_rank as kernels
    from trace_replay_core._logprob import logprob_rank_workspace_bytes

    if not torch.cuda.is_available():
        sys.exit("bench/logprob_tuning.py needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    shipped = (kernels.LOGPROB_BLOCK, kernels.LOGPROB_NUM_WARPS)
    rows = []
    copy = copy_bandwidth()["d2d"]
    copy_gbps = copy["gbps_p50"]
    rows.append(dict(copy, variant="d2d_copy", gbps=copy_gbps))
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write); shipped BLOCK, warps = {shipped}", flush=True)
    for dtype_name in DTYPES:
        for batch in BATCHES:
            logits = (torch.randn(batch, VOCAB, device=dev) * 4).to(getattr(torch, dtype_name))
            ids = torch.randint(0, VOCAB, (batch,), device=dev)
            nbytes = logits.numel() * logits.element_size()
            n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
            copies = [logits] + [logits.clone() for _ in range(n_copies - 1)]
            ws_bytes = logprob_rank_workspace_bytes(batch, VOCAB)
            reference = None
            for block, warps in VARIANTS:
                outs = [(torch.empty(batch, device=dev), torch.empty(batch, dtype=torch.int64, device=dev))
                        for _ in copies]
                wss = [torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None for _ in copies]
                try:
                    bounds = [bind_variant(block, warps, x, ids, o, w, stream) for x, o, w in zip(copies, outs, wss)]
                except Exception as exc:  # noqa: BLE001 - e.g. too many registers: reported, not fatal
                    rows.append(dict(variant=f"{block}x{warps}", block=block, num_warps=warps, dtype=dtype_name,
                                     batch=batch, error=f"{type(exc).__name__}: {exc}"))
                    print(f"{block}x{warps} {dtype_name} B={batch}: {exc}", flush=True)
                    continue
                bounds[0](stream=stream)
                torch.cuda.synchronize()
                result = (outs[0][0].cpu().numpy(), outs[0][1].cpu().numpy())
                if reference is None:           # the shipped setting comes first in VARIANTS
                    reference = result
                same = bool(np.array_equal(reference[1], result[1]))
                diff = float(np.max(np.abs(reference[0].astype(np.float64) - result[0])))
                stats = time_cuda_queued(rotating([functools.partial(b, stream=stream) for b in bounds]))
                bw = bandwidth(nbytes, stats)
                rows.append(dict(variant=f"{block}x{warps}", block=block, num_warps=warps,
                                 shipped=(block, warps) == shipped, dtype=dtype_name, batch=batch, vocab=VOCAB,
                                 bytes=nbytes, gbps=bw["gbps_p50"],
                                 fraction_of_copy=bw["gbps_p50"] / copy_gbps, ranks_equal=same,
                                 max_abs_logprob_diff=diff, **stats, **bw))
                print(f"BLOCK {block:5d} warps {warps:2d} {dtype_name:9s} B={batch:5d} p50 {stats['us_p50']:8.2f} us "
                      f"{bw['gbps_p50']:7.0f} GB/s ({bw['gbps_p50'] / copy_gbps:.0%} of copy) ranks equal {same}",
                      flush=True)
                del bounds, outs, wss
            del logits, ids, copies
    path = write_results("logprob_tuning", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    print(table([r for r in rows if "us_p50" in r and r.get("variant") != "d2d_copy"],
                ["variant", "dtype", "batch", "us_p50", "us_p20", "us_p80", "gbps", "fraction_of_copy", "ranks_equal"]))


if __name__ == "__main__":
    main()
