"""Which block, warp count, chunking and loop form for the batch-invariant logprob kernels?

Question: rows are cut into chunks of ``chunk_blocks`` blocks of ``block`` logits, streamed by
programs of ``num_warps`` warps (one or several chunks per program, chosen from the batch:
``_chunk_group``); with top-k, each program then selects its best keys from the chunks it
streamed. Which choice reads the logits fastest at vocab 151,936, for bfloat16 and float32, at
batch 1 to 4096, and with top-k 20 (where chunks per program also set how often the selection
runs)?
Every choice is batch-invariant by construction; the ``invariant`` column checks it (the batch's
rows in other batches, bit for bit: ``harness.rows_same_bits``).

Method: each variant's plan (``plan_logprob_rank(..., block=, num_warps=, chunk_blocks=, words=)``)
and chunks per program (``group``) are bound through ``bind_logprob_rank_launch`` (the kernels'
launch function, integers only) and timed
with ``harness.time_cuda_queued`` (calls queued behind a busy kernel, host cost hidden) on
copies of the logits rotated so that L2 does not serve them (256 MiB in all, at most 32 copies).
Each variant's logprobs are compared with the shipped variant's (largest difference; ranks
and top-k ids must be equal). Reported: p20/p50/p80 in us and GB/s of logits read, next to the
device-to-device copy bandwidth (bytes read + written) measured in the same run.

Run: ``python bench/logprob_tuning.py [--topk-only | --argmax-only | --latency | --groups | --vocabs [SET]]``
on a GPU; writes ``bench/results/logprob_tuning.json`` (``--topk-only``: bfloat16 at batch 256 and 4096, plain
and top-k side by side; writes ``logprob_tuning_topk.json``; ``--argmax-only``: both dtypes at
batch 256 and 4096, plain and ``argmax=True`` with register caps; ``logprob_tuning_argmax.json``;
``--latency``: the shipped plan with the chunk kernel launched the ordinary way and as a chained
programmatic dependent launch, bfloat16 at batch 1 to 4096 with and without top-k and argmax,
float32; ``logprob_tuning_latency.json``; ``--groups``: the trials of ``GROUP_TRIALS``, chunks per
program and module constants of ``kernels.logprob_rank`` patched per variant;
``logprob_tuning_groups.json``; ``--vocabs [SET]``: a set of ``VOCAB_TRIALS``, other vocabularies
and layouts, the shipped plan against other chunk sizes, ``logprob_tuning_vocabs_<SET>.json``). Each row also
records the chunk kernel's registers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bandwidth, copy_bandwidth, rotating, rows_same_bits, table, time_cuda_queued, write_results  # noqa: E402

VOCAB = 151_936
BATCHES = (1, 64, 256, 4096)
DTYPES = ("bfloat16", "float32")
# Variants: (block, num_warps, chunk_blocks, words, group, pdl); the shipped default first.
# ``words`` False: the element path (the kernel before the fused bfloat16 path; float32 always
# takes it, so float32 runs only the variants with words True). ``group``: chunks per program
# forced (None: ``_chunk_group``'s choice from the batch). ``pdl`` False: the combine kernel
# launched the ordinary way instead of as a programmatic dependent launch.
CHUNK_VARIANTS = (
    (2048, 4, 6, True, None, True),
    (2048, 4, 6, True, None, False),
    (2048, 4, 6, False, None, True),
    (2048, 4, 4, True, None, True),
    (2048, 4, 8, True, None, True),
)
# With top-k, a seventh knob: the chunk kernel's register cap (``maxnreg``; None: the shipped one,
# 0: uncapped); the shipped plan first, then other caps and chunks per program.
# (results/logprob_tuning_topk_caps.json, 05:20 UTC: caps 56 and 48 and one chunk per program
# were slower at batch 256 and 4096.)
TOPK_VARIANTS = (
    (2048, 4, 6, True, None, True, None),
    (2048, 4, 6, True, None, True, 0),
    (2048, 4, 6, True, 4, True, None),
    (2048, 4, 6, True, 4, True, 72),
    (2048, 4, 6, True, None, True, 72),
)
# With argmax=True (every other row greedy): the chunk kernel's register cap per dtype (None:
# the shipped plan, uncapped); the plain call (no argmax) is timed beside them.
ARGMAX_CAPS = {"bfloat16": (None,), "float32": (None, 64)}
# --latency: on the shipped plan, with and without the chained programmatic launch
# (``LOGPROB_PDL_CHAIN``: the chunk kernel a dependent of the kernel before it), and for top-k the
# threshold's group maxima (``plan.sel``) and register cap.
# Two trials whose kernel knobs were not kept (results from the trial code, not this script):
# results/logprob_tuning_prefetch.json, 2026-12-02 09:32 UTC: an L2 prefetch of the blocks ahead
# with cp.async.bulk.prefetch.L2, 2 or 4 blocks ahead or a program's whole range at its start, was
# slower everywhere: bf16 batch 256 31.8-57.1 against 25.4 us, 4096 448-838 against 288.
# results/logprob_tuning_unroll.json, 09:41 UTC: the block loops unrolled by 1, 3 or 4 instead of
# 2 were slower or no faster; top-k with 64 group maxima or a cap of 72 registers 46.1 against
# 45.3 us at batch 256.
# results/logprob_tuning_ahead.json, 09:54 UTC: the kernels before and after a chunk's first two
# blocks were loaded ahead (before the token's loads, or at the end of the previous chunk), in one
# run. results/logprob_tuning_chunks.json, 10:01 UTC (this script with other variants): 4 or 8
# blocks per chunk 23.28 / 23.12 against 23.40 us at batch 256 and 296.3 / 286.2 against 288.3 at
# 4096, but 3.36 / 4.21 against 3.83 at batch 1; two chunks per program at batch 256 25.03; top-k
# with one chunk per program 48.45 against 43.48, capped at 72 registers 44.91, uncapped 46.00.
LATENCY_VARIANTS = ({"chain": False}, {})
LATENCY_TOPK_VARIANTS = ({"chain": False}, {})
TOP_K = 20
# --groups: chunks per program on the shipped plan (each program issues its next chunk's first
# blocks before a chunk's reductions), other plan knobs, and module constants of
# kernels.logprob_rank patched per variant (``patch``); each trial is a dict of them. Earlier runs
# (bench/README.md has the tables), device time p50, bf16 unless said:
# - 11:50 UTC: 4 blocks ahead faster at batch 1 (3.71 against 3.80 us) and with argmax (28.01
#   against 29.34) but slower at 256 (23.96 against 23.34) and 4096 (288.5 against 286.0); two
#   chunks per program at 1024 74.97 against 75.98 (four), at 4096 291.2 against 286.0.
# - 14:16 UTC (log only): an L2 prefetch of each program's chunks, as one
#   cp.async.bulk.prefetch.L2 per chunk or one prefetch.global.L2 per 128-byte line, slower
#   everywhere: 25.81 / 26.30 against 23.57 us at batch 256, 384.1 / 402.6 against 291.3 at 4096,
#   float32 at 256 48.83 / 52.18 against 40.90, top-k 20 at 256 40.42 / 40.71 against 37.86
#   (removed). argmax=True with its chunk end before the next chunk's loads (shipped): 27.35 at 256.
# - 14:19 UTC (results/logprob_tuning_grid.json): three chunks per program at 256 23.56 against
#   23.38 (and 75.49 against 76.05 at 1024, 288.5 against 286.1 at 4096); a cap of 48 registers
#   (10 programs per SM instead of 9, 6 bytes of spills) slower everywhere (24.04 at 256); 8 or 5
#   blocks per chunk 23.10 / 24.04 at 256; top-k with three chunks per program 130.4 against 37.65.
# - 14:25 UTC (results/logprob_tuning_groups.json): 8 warps per program 25.69 against 23.60 us
#   at 256, 307.7 against 291.4 at 4096 (4 blocks ahead, 12 blocks per chunk, a 32-register cap:
#   no better), top-k 20 48.81 against 37.88.
# - 15:16 UTC: whether the programmatic dependent launches (the chunk kernel chained to the
#   kernel before it, the combine kernel to the chunk kernel) are what costs the 8-warp plan, as
#   a bare 8-warp read without them takes 20.95 us at 256 (read_floor.py): no, they help either
#   way (results/logprob_tuning_pdl.json): at 256 4 warps 23.54 us, 25.02 unchained, 26.54
#   without them; 8 warps 25.70, 27.56, 28.40; at 4096 8 warps 307.5 / 308.8.
# - 16:10 UTC (results/logprob_tuning_evict.json): the whole blocks loaded evict-first in L1 and
#   L2 faster at every batch but 1 (bf16 256 23.40 against 23.55 us, 4096 287.1 against 291.2,
#   float32 4096 557.9 against 569.4, top-k 20 at 256 35.64 against 36.80): shipped. Top-k
#   programs writing their keys unsorted when they are no more than k_pad: 36.80 against 37.91 at
#   256, 423.4 against 440.1 at 4096: shipped. Chunks of 4 blocks all loaded ahead, or of 2: faster
#   at batch 1 (3.29 / 3.19 against 3.89 us), slower at 256 (23.76 / 24.71, one chunk per program
#   26.49) and 4096 (295.4 / 319.3): not kept.
# - 16:13 UTC (results/logprob_tuning_topk_combine.json; top-k 20 at 256, the plain call 23.27 us
#   beside it): the combine kernel with 2 or 8 warps 36.17 / 36.21 against 35.56 (4); the chunk
#   kernel capped at 72 registers 35.57, uncapped (91) 38.21; candidate vectors read back 32 at a
#   time 35.25 against 35.56 / 35.52 (64): shipped. At batch 1 the combine with 8 warps 9.88
#   against 9.64.
# - 16:14 UTC (results/logprob_tuning_topk_pairs.json; plain call 23.24 us): candidate vectors
#   read back 16 at a time 37.45 against 35.25 / 35.18 (32); the combine kernel merging 4 key sets
#   at a time 36.46, both 38.76.
# - 16:15 UTC (results/logprob_tuning_topk_sel.json; plain call 23.28 us): the
#   threshold from 256 line maxima (every line) or 64 group maxima 36.19 / 36.22 against 35.23 /
#   35.17 (128): unchanged.
# - 16:43 UTC, the trials below (results/logprob_tuning_shift.json): rows of 151,936 logits in
#   rows of 151,937 (not 16-byte aligned) on the element path with each line's words shifted into
#   place (shipped) or a logit per load (LOGPROB_SHIFT_ELEMENTS False, the former kernels), aligned
#   rows beside them: float32 batch 256 44.13 against 53.96 us (aligned 39.45), 4096 585.3 against
#   758.3; float16 256 28.77 against 64.63, 4096 364.0 against 936.7; float32 top-k 20 at 256
#   169.8 against 623.9.
# - 17:10 UTC, the trials below (results/logprob_tuning_unroll_f32.json; its chunk_regs column
#   shows the default build's registers for every variant, fixed since): float32 rows that are not aligned with the
#   element path's block loop unrolled once or twice (LOGPROB_SHIFTED_F32_UNROLL then, applied
#   to every call): once 45.39 against 44.17 us at 256, 596.9 against 585.4 at 4096, argmax=True
#   57.03 against 52.59, but top-k 20 at 256 97.85 against 169.67. Shipped: once with top-k only
#   (LOGPROB_SHIFTED_F32_TOPK_UNROLL).
# - 18:05 UTC (results/logprob_tuning_chunk_only.json): the chunk kernel alone (``chunk_only``:
#   the combine kernel not queued; timing only) 21.48 against 23.23 us for the call at batch 256,
#   272.53 against 278.57 at 4096: the combine kernel, and the wait for it, cost 1.75 us of a
#   batch-256 call. Blocks of 1,024 at 4 warps (one line per thread per block, 40 registers)
#   4.33 / 23.24 / 74.56 / 279.32 us at batch 1 / 256 / 1024 / 4096 against 3.82 / 23.23 /
#   73.96 / 278.57; blocks of 512 at 4 warps (64 lines over 128 threads) 6.07 / 26.88 / 90.03 /
#   309.60.
# - 18:12 UTC (results/logprob_tuning_fused.json; trial code, not kept): the row's last program
#   merging its partials inside the chunk kernel, no combine kernel (an arrival count per row in
#   a zeroed workspace, ``atom.acq_rel.gpu`` after the partials' stores, the partials read back
#   ``.cg``; the same bits as the combine kernel's): slower everywhere, batch 1 4.14 against 3.82
#   us, 256 23.52 / 23.58 against 23.28 / 23.28, 1024 74.39 against 74.17, 4096 280.07 against
#   278.85, float32 at 256 40.44 against 39.75, bfloat16 rows of 151,937 at 256 30.52 against
#   28.49 (70 registers against 64): every program's arrival is a round trip to L2 at its end
#   while it holds its slot. 2 warps over blocks of 1,024 (the same chunks, two lines per thread
#   per block): 4.89 / 24.28 / 283.41 us at batch 1 / 256 / 4096; with the fused merge 23.95 at 256.
# - 18:25 UTC (results/logprob_tuning_release.json): the combine kernel letting the next kernel's
#   programs be scheduled before it waits for the chunk kernel (LOGPROB_COMBINE_RELEASE_FIRST,
#   shipped since) against after: bf16 batch 1 4.00 against 3.83 us, 256 22.74 / 22.71 against
#   23.22 / 23.20, 1024 74.72 against 74.98, 4096 277.72 against 279.36, float32 at 256 39.21
#   against 39.64, top-k 20 at 256 34.78 against 34.92, argmax=True 26.51 against 26.92. Chunks
#   of 8 blocks (10 per row, 2.2 waves of programs at 256 against 2.8) with it: 22.38 at 256 and
#   275.84 at 4096, but 4.36 at batch 1 and top-k 20 35.22 (1.57x the plain call): not taken.
# - 20:00 UTC (results/logprob_tuning_release2.json): the same, at commit 97276c9: 22.90 against
#   23.37 us at 256, the chunk kernel alone 21.62.
# - 23:12 UTC (results/logprob_tuning_cluster.json): a row's programs launched as one cluster
#   whose first merges the row (one kernel, LOGPROB_CLUSTER), at every batch, against the chunk
#   and combine kernels: batch 1 3.85 against 3.96 us, 64 9.43 against 10.21, but 256 26.91
#   against 22.98, 1024 92.39 against 76.06, 4096 340.3 against 283.3; float32 256 46.22 against
#   39.77, argmax=True 35.18 against 26.61, rows of 151,937 36.78 against 28.12; at 256 with 2
#   chunks per program 25.72, chunks of 8 blocks 26.35. The same bits in every row. Shipped for
#   calls whose rows' clusters fit on the device at once only.
# The trials below: the shipped choice (clusters where the rows fit at once) against the two
# kernels at batches around that limit.
TWO_KERNELS = {"patch": {"LOGPROB_CLUSTER": False}}
GROUP_TRIALS = {
    ("bfloat16", 1, 0): ({}, TWO_KERNELS),
    ("bfloat16", 16, 0): ({}, TWO_KERNELS),
    ("bfloat16", 64, 0): ({}, TWO_KERNELS),
    ("bfloat16", 96, 0): ({}, TWO_KERNELS),
    ("bfloat16", 128, 0): ({}, TWO_KERNELS),
    ("bfloat16", 160, 0): ({}, TWO_KERNELS),
    ("bfloat16", 256, 0): ({}, TWO_KERNELS),
    ("float32", 64, 0): ({}, TWO_KERNELS),
    ("bfloat16", 64, "argmax"): ({}, TWO_KERNELS),
    ("bfloat16", 64, 0, VOCAB + 1): ({}, TWO_KERNELS),
}
# --vocabs SET: a set of VOCAB_TRIALS, each trial (dtype, vocabulary, row stride, other chunk sizes in
# blocks), run at VOCAB_BATCHES and with top-k TOP_K at batch 256, the shipped plan (about
# LOGPROB_CHUNKS chunks per row) first. "survey": the vocabularies of model families people run
# (Mistral 32,768; GPT-2 50,257, rows contiguous, so not 16-byte aligned; Llama 3 128,256;
# Qwen2.5 151,936; Gemma 3 262,144). "shift": after the survey (06:49 UTC) found GPT-2's rows
# faster in chunks of 3 or 4 blocks than in the shipped 2: the same vocabulary in aligned rows
# (a padded stride) and in float32, Llama 2's 32,000, and a small vocabulary not aligned.
VOCAB_TRIALS = {
    "survey": (
        ("bfloat16", 32_768, 32_768, (4, 8, 16)),
        ("bfloat16", 50_257, 50_257, (3, 4, 7)),
        ("bfloat16", 128_256, 128_256, (4, 8)),
        ("bfloat16", VOCAB, VOCAB, (8,)),
        ("bfloat16", 262_144, 262_144, (8, 16)),
    ),
    "shift": (
        ("bfloat16", 50_257, 50_264, (3, 4)),
        ("float32", 50_257, 50_257, (3, 4)),
        ("bfloat16", 32_000, 32_000, (3,)),
        ("bfloat16", 10_001, 10_001, (3,)),
    ),
}
VOCAB_BATCHES = (1, 64, 256, 4096)
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32


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
        # Room for any variant's plan (smaller blocks need more partials).
        self.ws = torch.empty(logprob_rank_workspace_bytes(batch, vocab, top_k) * 8 + 64, dtype=torch.uint8, device=dev)
        self.logits, self.ids, self.top_k = logits, ids, top_k
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

    def bind(self, plan, group=None):
        from trace_replay_core.kernels.logprob_rank import bind_logprob_rank_launch, workspace_layout

        assert workspace_layout(self.args.batch, plan)[-1] <= self.ws.numel()
        return bind_logprob_rank_launch(self.args, self.dtypes, self.logits.device.index, plan, group)

    def bind_chunk_only(self, plan, group=None):
        """``launch(stream)`` of the chunk kernel alone, queued as the call queues it (timing only:
        without the combine kernel the call's outputs are not written)."""
        from trace_replay_core.kernels.logprob_rank import LOGPROB_PDL_CHAIN, _compiled_launches

        kernel, grid, ptrs, ints, gdc, cluster = _compiled_launches(
            self.args, self.dtypes, self.logits.device.index, plan, group
        )[0]
        return kernel.bind(grid, *ptrs, *ints, pdl=gdc and LOGPROB_PDL_CHAIN, cluster=cluster)

    def chunk_registers(self, plan, group=None):
        """Registers per thread and spilled bytes of the chunk kernel this plan compiles to, and
        the launch form: the clusters a row's programs form and how many the device holds at
        once (0, 0 for the two kernels)."""
        from trace_replay_core.kernels.logprob_rank import _compiled_launches

        kernel, grid, *_, cluster = _compiled_launches(self.args, self.dtypes, self.logits.device.index, plan, group)[0]
        held = kernel.max_active_clusters(grid, cluster) if cluster else 0
        return kernel.n_regs, kernel.n_spills, (cluster[1] if cluster else 0, held)

    def results(self):
        out = [self.lp.clone(), self.rk.clone()]
        if self.top_k:
            out += [self.tlp[:, : self.top_k].clone(), self.tid[:, : self.top_k].clone()]
        if self.am is not None:
            out += [self.am.clone(), self.am.clone()]  # (compared as a rank-like output)
        return out


def patched(constants):
    """Bind with module constants of ``kernels.logprob_rank`` replaced (trials)."""
    from trace_replay_core.kernels import logprob_rank

    return mock.patch.multiple(logprob_rank, **constants) if constants else contextlib.nullcontext()


def forced_pdl(pdl):
    """Bind with the combine kernel launched the ordinary way where ``pdl`` is False."""
    return patched({} if pdl else {"LOGPROB_PDL": False})


def forced_chain(chain):
    """Bind with the chunk kernel launched as a programmatic dependent launch (``chain`` True) or
    the ordinary way (False); None: the shipped choice."""
    return patched({} if chain is None else {"LOGPROB_PDL_CHAIN": bool(chain)})


def run_once(torch, call, plan, stream, group=None):
    call.bind(plan, group)(stream)
    torch.cuda.synchronize()
    return call.results()


def invariant(torch, logits, ids, top_k, plan, stream, result, argmax=False) -> bool:
    """Whether the batch's rows give the bits they have in the batch in other batches
    (``harness.rows_same_bits``), each batch with its own chunks per program."""

    def rows_run(rows):
        return run_once(torch, Call(torch, logits[rows].clone(), ids[rows].clone(), top_k, argmax), plan, stream)

    return rows_same_bits(rows_run, result, logits.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--topk-only",
        action="store_true",
        help="bfloat16 at batch 256 and 4096 only: the shipped plain call and the top-k variants",
    )
    ap.add_argument(
        "--argmax-only",
        action="store_true",
        help="batch 256 and 4096 only: the shipped plain call and argmax=True with register caps",
    )
    ap.add_argument("--groups", action="store_true", help="chunks per program (GROUP_TRIALS) on the shipped plan")
    ap.add_argument(
        "--vocabs",
        nargs="?",
        const="survey",
        choices=sorted(VOCAB_TRIALS),
        help="a set of VOCAB_TRIALS (default: survey): the shipped plan and other chunk sizes",
    )
    ap.add_argument(
        "--latency",
        action="store_true",
        help="the shipped plan with and without the chained launch (bfloat16 plain, top-k and argmax, float32)",
    )
    opts = ap.parse_args()
    import torch

    from trace_replay_core.kernels.logprob_rank import plan_logprob_rank

    if not torch.cuda.is_available():
        sys.exit("bench/logprob_tuning.py needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream().cuda_stream
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()["d2d"]["gbps_p50"]
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    if opts.groups:
        base = CHUNK_VARIANTS[0] + (None,)
        # a key's optional fourth item: the row stride (rows of VOCAB logits, padded: not 16-byte aligned)
        cases = [
            (key[0], key[1], key[2], tuple(base + (v,) for v in vs)) + tuple(key[3:])
            for key, vs in GROUP_TRIALS.items()
        ]
    elif opts.vocabs:
        base = CHUNK_VARIANTS[0]  # the shipped plan, its chunk size from the vocabulary (None) or another
        cases = [
            (dtype, b, k, tuple(base[:2] + (c,) + base[3:] for c in (None,) + more), stride, vocab)
            for dtype, vocab, stride, more in VOCAB_TRIALS[opts.vocabs]
            for b, k in [(b, 0) for b in VOCAB_BATCHES] + [(256, TOP_K)]
        ]
    elif opts.latency:
        base = CHUNK_VARIANTS[0] + (None,)
        plain, topk = (tuple(base + (v,) for v in vs) for vs in (LATENCY_VARIANTS, LATENCY_TOPK_VARIANTS))
        cases = (
            [("bfloat16", b, 0, plain) for b in (1, 256, 4096)]
            + [("bfloat16", b, TOP_K, topk) for b in (256, 4096)]
            + [("float32", b, 0, plain) for b in (256, 4096)]
            + [("bfloat16", 256, "argmax", plain)]
        )
    elif opts.argmax_only:
        cases = [
            c
            for d in DTYPES
            for b in (256, 4096)
            for c in (
                (d, b, 0, CHUNK_VARIANTS[:1]),
                (d, b, "argmax", tuple(CHUNK_VARIANTS[0] + (cap,) for cap in ARGMAX_CAPS[d])),
            )
        ]
    elif opts.topk_only:
        cases = [
            c
            for b in (256, 4096)
            for c in (("bfloat16", b, 0, CHUNK_VARIANTS[:1]), ("bfloat16", b, TOP_K, TOPK_VARIANTS))
        ]
    else:
        cases = [(d, b, 0, CHUNK_VARIANTS) for d in DTYPES for b in BATCHES] + [
            ("bfloat16", b, TOP_K, TOPK_VARIANTS) for b in (256, 4096)
        ]
    for dtype_name, batch, top_k, variants, *layout in cases:
        stride = layout[0] if layout else VOCAB  # rows of vocab logits, stride elements apart
        vocab = layout[1] if len(layout) > 1 else VOCAB
        argmax = top_k == "argmax"
        top_k = 0 if argmax else top_k
        logits = (torch.randn(batch, stride, device=dev) * 4).to(getattr(torch, dtype_name))[:, :vocab]
        ids = torch.randint(0, vocab, (batch,), device=dev)
        if argmax:
            ids[1::2] = -1  # greedy rows
        nbytes = logits.numel() * logits.element_size()
        n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
        calls = [Call(torch, logits, ids, top_k, argmax)] + [
            Call(
                torch,
                torch.empty(batch, stride, dtype=logits.dtype, device=dev)[:, :vocab].copy_(logits),
                ids,
                top_k,
                argmax,
            )
            for _ in range(n_copies - 1)
        ]
        shipped = None
        for variant in variants:
            block, warps, chunk_blocks, words, group, pdl, *extra = variant
            cap = extra[:1]
            more = dict(extra[1]) if len(extra) > 1 else {}  # --latency: plan and launch knobs
            chain = more.pop("chain", None)
            patch = more.pop("patch", {})  # module constants of kernels.logprob_rank
            sel = more.pop("sel", None)
            group = more.pop("group", group)
            chunk_only = more.pop("chunk_only", False)
            if dtype_name == "float32" and (not words or group is not None or not pdl):
                continue
            knobs = dict(block=block, num_warps=warps, chunk_blocks=chunk_blocks, words=words)
            if cap and cap[0] is not None:
                knobs["maxnreg"] = cap[0]
            knobs.update(more)
            plan = plan_logprob_rank(vocab, logits.element_size(), top_k, **knobs)
            if sel is not None:
                plan = plan._replace(sel=sel)
                knobs["sel"] = sel
            if group is not None:
                knobs["group"] = group
            if not pdl:
                knobs["pdl"] = False
            if chain is not None:
                knobs["chain"] = chain
            knobs.update(patch)
            if chunk_only:
                knobs["chunk_only"] = True
            name = " ".join(f"{k} {v!s:5s}" for k, v in knobs.items())
            row = dict(
                dtype=dtype_name,
                batch=batch,
                vocab=vocab,
                top_k=top_k,
                argmax=argmax,
                **knobs,
                n_chunks=plan.n_chunks,
                shipped_maxnreg=plan.maxnreg,
                bytes=nbytes,
                copy_gbps=copy_gbps,
            )
            try:
                checks, note = {}, "(chunk kernel only)"  # chunk_only: timing only, no outputs to check
                if not chunk_only:
                    with forced_pdl(pdl), forced_chain(chain), patched(patch):
                        result = run_once(torch, calls[0], plan, stream, group)
                        inv = invariant(torch, logits, ids, top_k, plan, stream, result, argmax)
                    shipped = shipped if shipped is not None else result
                    same = all(torch.equal(a, b) for a, b in zip(result[1::2], shipped[1::2]))  # ranks, top-k ids
                    diff = float((result[0] - shipped[0]).abs().max())
                    checks = dict(invariant=inv, equal_to_shipped=same, max_abs_logprob_diff_to_shipped=diff)
                    note = f"invariant {inv} same {same} diff {diff:.1e}"
                with forced_pdl(pdl), forced_chain(chain), patched(patch):
                    launches = [c.bind_chunk_only(plan, group) if chunk_only else c.bind(plan, group) for c in calls]
                    regs, spills, form = calls[0].chunk_registers(plan, group)  # this variant's build
                stats = time_cuda_queued(rotating([lambda f=f: f(stream) for f in launches]))
                row.update(
                    stats,
                    **bandwidth(nbytes, stats),
                    **checks,
                    chunk_regs=regs,
                    chunk_spills=spills,
                    cluster_ctas=form[0],
                    clusters_held=form[1],
                )
                print(
                    f"{dtype_name:9s} B={batch:5d} k={top_k:2d} argmax={argmax:d} {name} "
                    f"p50 {stats['us_p50']:8.2f} us [{stats['us_p20']:.2f}, {stats['us_p80']:.2f}] "
                    f"{row['gbps_p50']:6.0f} GB/s {note} regs {regs}/{spills} clusters {form}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                row.update(error=f"{type(exc).__name__}: {exc}"[:400])
                print(f"{dtype_name} B={batch} {name}: FAILED {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)
        logits = ids = calls = None
        torch.cuda.empty_cache()
    path = write_results(
        "logprob_tuning_groups"
        if opts.groups
        else f"logprob_tuning_vocabs_{opts.vocabs}"
        if opts.vocabs
        else "logprob_tuning_latency"
        if opts.latency
        else "logprob_tuning_argmax"
        if opts.argmax_only
        else "logprob_tuning_topk"
        if opts.topk_only
        else "logprob_tuning",
        rows,
    )
    print(f"\nwrote {path}\n")
    print(
        table(
            [r for r in rows if "us_p50" in r],
            [
                "dtype",
                "vocab",
                "batch",
                "top_k",
                "argmax",
                "block",
                "num_warps",
                "chunk_blocks",
                "words",
                "group",
                "pdl",
                "maxnreg",
                "sel",
                "chain",
                "chunk_only",
                "COMBINE_NUM_WARPS",
                "chunk_regs",
                "n_chunks",
                "shipped_maxnreg",
                "us_p50",
                "gbps_p50",
                "invariant",
            ],
        )
    )


if __name__ == "__main__":
    main()
