"""Which row split, program size and launch form for the batch-invariant logprob kernels?

Question: the plan (``kernels.logprob_rank.plan_logprob_rank``) cuts rows into chunks of
``chunk_blocks`` blocks of ``block`` logits, runs ``group`` chunks per program of ``num_warps``
warps, caps the top-k chunk kernel's registers (``maxnreg``) and, on sm_90+, merges a row in a
cluster when the rows fit at once (``cluster``). Is the shipped choice still the fastest at the
bench's shapes, and for other vocabularies?

Method: each trial is a dict of plan options; its variant (``plan_for_call(args, dtypes, **options)``)
is bound with ``bind_logprob_rank_launch(..., variant)`` (no module state is changed) and timed
with ``harness.time_cuda_queued`` (calls queued behind a busy kernel) on copies of the logits
rotated so that L2 does not serve them (256 MiB in all, at most 32 copies). Each trial's results
are compared with the shipped plan's (ranks and top-k ids equal; largest logprob difference),
and ``invariant`` checks the batch's rows in other batches bit for bit
(``harness.rows_same_bits``). Rows record the chunk kernel's registers and spills.

Modes (``--mode``), each writing ``bench/results/logprob_tuning_<mode>.json``:
- ``split``: chunk sizes and warps at vocabulary 151,936, bfloat16 and float32, batch 1 to 4096;
- ``topk``: top-k 20 register caps and chunks per program, batch 256 and 4096;
- ``cluster``: the cluster form against two kernels, batch 1 to 256;
- ``vocabs``: other vocabularies and layouts, the shipped chunk size against others.

Run: ``python bench/tuning/logprob_tuning.py --mode split`` on a GPU (not imported by the
library or the tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import bandwidth, copy_bandwidth, rotating, rows_same_bits, time_cuda_queued, write_results  # noqa: E402

VOCAB = 151_936
TOP_K = 20
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32
SHIPPED: dict = {}  # the plan's own choice; every trial list starts with it
# (dtype, batch, top_k or "argmax", vocab, row stride, trials)
MODES: dict[str, list[tuple]] = {
    "split": [
        (d, b, 0, VOCAB, VOCAB, (SHIPPED, {"chunk_blocks": 4}, {"chunk_blocks": 8}, {"num_warps": 8}))
        for d in ("bfloat16", "float32")
        for b in (1, 64, 256, 4096)
    ],
    "topk": [
        ("bfloat16", b, TOP_K, VOCAB, VOCAB, (SHIPPED, {"maxnreg": 0}, {"maxnreg": 72}, {"group": 1}))
        for b in (256, 4096)
    ],
    "cluster": [
        (d, b, k, VOCAB, VOCAB, (SHIPPED, {"cluster": False}))
        for d, k in (("bfloat16", 0), ("float32", 0), ("bfloat16", "argmax"))
        for b in (1, 16, 64, 128, 256)
    ],
    "vocabs": [
        (d, b, k, vocab, stride, (SHIPPED,) + tuple({"chunk_blocks": c} for c in more))
        for d, vocab, stride, more in (
            ("bfloat16", 32_000, 32_000, (3,)),
            ("bfloat16", 50_257, 50_257, (2, 7)),
            ("float32", 50_257, 50_257, (2,)),
            ("bfloat16", 50_257, 50_264, (2,)),
            ("bfloat16", 10_001, 10_001, (1,)),
            ("bfloat16", 128_256, 128_256, (8,)),
            ("bfloat16", 262_144, 262_144, (16,)),
        )
        for b, k in ((1, 0), (64, 0), (256, 0), (4096, 0), (256, TOP_K))
    ],
}


class Call:
    """The tensors and integer arguments of one call of ``[batch, vocab]`` logits."""

    def __init__(self, torch, logits, ids, top_k, argmax=False):
        from trace_replay_core._logprob import logprob_rank_workspace_bytes
        from trace_replay_core.kernels.logprob_rank import LogprobRankArgs, LogprobRankDtypes

        batch, vocab = logits.shape
        dev = logits.device
        self.lp = torch.empty(batch, device=dev)
        self.rk = torch.empty(batch, dtype=torch.int64, device=dev)
        self.tlp = torch.empty(batch, max(top_k, 1), device=dev)
        self.tid = torch.empty(batch, max(top_k, 1), dtype=torch.int64, device=dev)
        self.am = torch.empty(batch, dtype=torch.int64, device=dev) if argmax else None
        # room for a trial that cuts rows into more chunks than the shipped plan
        self.ws = torch.empty(logprob_rank_workspace_bytes(batch, vocab, top_k) * 8 + 64, dtype=torch.uint8, device=dev)
        self.logits, self.top_k = logits, top_k
        self.args = LogprobRankArgs(
            logits.data_ptr(),
            ids.data_ptr(),
            0,
            self.lp.data_ptr(),
            self.rk.data_ptr(),
            self.tlp.data_ptr() if top_k else 0,
            self.tid.data_ptr() if top_k else 0,
            self.ws.data_ptr(),
            batch,
            vocab,
            logits.stride(0),
            top_k,
            self.am.data_ptr() if argmax else 0,
        )
        self.dtypes = LogprobRankDtypes(str(logits.dtype).replace("torch.", ""), "int64", "int64", "int64", "int64")

    def variant(self, options: dict):
        from trace_replay_core._cuda import compute_capability
        from trace_replay_core.kernels.logprob_rank import plan_for_call, workspace_layout

        sm90 = compute_capability(self.logits.device.index) >= (9, 0)
        variant = plan_for_call(self.args, self.dtypes, sm90=sm90, **options)
        if workspace_layout(self.args.batch, variant)[-1] > self.ws.numel():
            raise ValueError(f"options {options} need more workspace than this bench allocates")
        return variant

    def bind(self, options: dict):
        from trace_replay_core.kernels.logprob_rank import bind_logprob_rank_launch

        device = self.logits.device.index
        return bind_logprob_rank_launch(self.args, self.dtypes, device, self.variant(options))

    def chunk_registers(self, options: dict):
        """Registers per thread and spilled bytes of the chunk kernel, and whether the call runs
        in clusters (a variant whose rows do not fit at once runs as two kernels)."""
        from trace_replay_core.kernels.logprob_rank import _compiled_launches

        variant, launches = _compiled_launches(self.args, self.dtypes, self.logits.device.index, self.variant(options))
        return launches[0][0].n_regs, launches[0][0].n_spills, variant.cluster

    def results(self):
        out = [self.lp.clone(), self.rk.clone()]
        if self.top_k:
            out += [self.tlp[:, : self.top_k].clone(), self.tid[:, : self.top_k].clone()]
        if self.am is not None:
            out += [self.am.clone(), self.am.clone()]  # (compared as a rank-like output)
        return out


def run_once(torch, call, options, stream):
    call.bind(options)(stream)
    torch.cuda.synchronize()
    return call.results()


def measure(torch, calls, logits, ids, top_k, argmax, options, stream, shipped):
    """One trial's row fields: timing, checks against the shipped plan, registers."""
    result = run_once(torch, calls[0], options, stream)

    def rows_run(rows, options=options):
        return run_once(torch, Call(torch, logits[rows].clone(), ids[rows].clone(), top_k, argmax), options, stream)

    inv = rows_same_bits(rows_run, result, logits.shape[0])
    shipped = shipped if shipped is not None else result
    same = all(torch.equal(a, b) for a, b in zip(result[1::2], shipped[1::2]))  # ranks, top-k ids
    diff = float((result[0] - shipped[0]).abs().max())
    launches = [c.bind(options) for c in calls]
    regs, spills, cluster = calls[0].chunk_registers(options)
    stats = time_cuda_queued(rotating([lambda f=f: f(stream) for f in launches]))
    fields = dict(stats, invariant=inv, equal_to_shipped=same, max_abs_logprob_diff_to_shipped=diff)
    return result, dict(fields, chunk_regs=regs, chunk_spills=spills, cluster=cluster)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="split")
    opts = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/tuning/logprob_tuning.py needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream().cuda_stream
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()["d2d"]["gbps_p50"]
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    for dtype_name, batch, top_k, vocab, stride, trials in MODES[opts.mode]:
        argmax = top_k == "argmax"
        top_k = 0 if argmax else top_k
        logits = (torch.randn(batch, stride, device=dev) * 4).to(getattr(torch, dtype_name))[:, :vocab]
        ids = torch.randint(0, vocab, (batch,), device=dev)
        if argmax:
            ids[1::2] = -1  # greedy rows
        nbytes = logits.numel() * logits.element_size()
        n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
        copies = [logits] + [
            torch.empty(batch, stride, dtype=logits.dtype, device=dev)[:, :vocab].copy_(logits)
            for _ in range(n_copies - 1)
        ]
        calls = [Call(torch, c, ids, top_k, argmax) for c in copies]
        shipped = None
        for options in trials:
            name = " ".join(f"{k} {v}" for k, v in options.items()) or "shipped"
            row = dict(dtype=dtype_name, batch=batch, vocab=vocab, row_stride=stride, top_k=top_k, argmax=argmax)
            row.update(options=dict(options), bytes=nbytes, copy_gbps=copy_gbps)
            try:
                variant = calls[0].variant(options)
                row.update(block=variant.block, chunk_blocks=variant.chunk_blocks, n_chunks=variant.n_chunks)
                row.update(group=variant.group, num_warps=variant.num_warps, maxnreg=variant.maxnreg)
                result, fields = measure(torch, calls, logits, ids, top_k, argmax, options, stream, shipped)
                shipped = shipped if shipped is not None else result
                row.update(fields, **bandwidth(nbytes, fields))
                print(
                    f"{dtype_name:9s} V={vocab} S={stride} B={batch:5d} k={top_k:2d} argmax={argmax:d} {name}: "
                    f"p50 {fields['us_p50']:8.2f} us {row['gbps_p50']:6.0f} GB/s invariant {fields['invariant']} "
                    f"same {fields['equal_to_shipped']} regs {fields['chunk_regs']}/{fields['chunk_spills']}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - a trial that fails is reported, not fatal
                row.update(error=f"{type(exc).__name__}: {exc}"[:400])
                print(f"{dtype_name} B={batch} {name}: FAILED {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)
        del logits, ids, calls, copies
        torch.cuda.empty_cache()
    print(f"\nwrote {write_results(f'logprob_tuning_{opts.mode}', rows)}\n")


if __name__ == "__main__":
    main()
