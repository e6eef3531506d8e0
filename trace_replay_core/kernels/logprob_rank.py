"""Logprob, rank and top-k of one token per row, one read of the logits, the same bits at any batch size.

For row ``b`` with token ``t = token_ids[b]``, temperature ``T = temperature[b]`` (1 without one)
and ``y = logits[b, :vocab] / T`` in float32 (bfloat16 and float16 convert exactly):

- ``logprob[b] = y[t] - log(sum(exp(y)))``;
- ``rank[b] = count(y >= y[t])`` (vLLM's definition: a unique argmax has rank 1; IEEE
  comparisons, so NaN entries never count);
- optionally the ``top_k`` largest ``y`` as logprobs and their token ids, sorted descending,
  ties broken by the lower id; NaN entries are never selected.

Batch invariance, without top-k (the common call). Each row is cut into ``n_chunks`` chunks of
``chunk_blocks`` whole blocks of ``BLOCK`` logits, both fixed by the vocabulary alone
(:func:`plan_logprob_rank`; 151,936 logits: 13 chunks of 6 blocks of 2048; GPT-2's 50,257: 7
chunks of 4 blocks). Program ``(b, g)``
of :func:`logprob_rank_chunk_kernel` streams chunks ``g * group ...`` of row ``b`` once (``group``
consecutive chunks per program, a runtime value chosen from the batch for speed: the same
compiled kernel and the same instructions per chunk at every batch size), keeping a running
maximum and sum of exponentials per 16-byte line of the block inside each thread and a count of
``y >= y[t]``, reduces its lines in a fixed order at the end and writes the partial
``(m, s, count)``; :func:`logprob_rank_combine_kernel` merges a row's partials in chunk order
(one warp per row; four with top-k). Nothing depends on the batch, the row's position or the
other rows: the compiled kernels depend on the dtypes, the vocabulary, whether rows are 16-byte
aligned (a property of the layout: contiguous rows of a vocabulary are aligned alike at every
batch size, one row alone included, :func:`_layout_stride`), top-k and temperature, never on the
batch. A layout that changes the alignment (rows padded to a stride that is not a multiple of 16
bytes, a base address off 16 bytes) takes other kernels (``SHIFT``: each line read as the two
aligned 16-byte vectors around it and its words shifted into place, so that every thread holds
the same logits in the same registers as in an aligned row) and gives the same bits. The
program that holds a row's first chunk also writes the row's token logit and whether its id is
valid to the workspace, so the combine kernel reads them with the partials instead of loading
the id and then its logit (two dependent round trips less).

The bfloat16 fast path (no temperature: ``WORDS``). The chunk kernel reads whole blocks as 32-bit
words of two logits (widened by a shift and a mask); in rows that are not 16-byte aligned
(``SHIFT``: GPT-2's 50,257 logits per row, a padded stride) it reads the two aligned 16-byte
vectors around each line and shifts the line's words into place, so each thread holds the same
logits in the same registers as in an aligned row and every later step is the same. It computes each
exponent with one fused multiply-add against a per-line offset ``mc = clamp(m, +-2**20) *
log2(e)`` and undoes the offset's rounding at the chunk's end (``2**(mc - max * log2(e))``, one
rounding), and counts ``y >= y[t]`` with one packed ``bf16x2`` compare per word. A chunk whose
maximum is finite beyond ``+-2**20`` (a row masked with ``finfo.min`` instead of -inf, say) has
its sum flagged (-1); the combine kernel sums such a chunk again in the plain form when it lies
within 128 of the row's maximum (else it adds nothing either way). Which chunks are flagged
depends on their own logits only, so the path is as batch-invariant as the other; its bits
differ from the element path's (other dtypes) in the last places. Each chunk's first
``LOGPROB_AHEAD`` blocks are loaded ahead of its block loop: a program's first chunk's with the
token's two dependent loads (id, then logit), the next chunk's after the previous chunk's blocks
and before its reductions (their barriers), so that a program keeps loads in flight across a
chunk boundary (with ``ARGMAX`` after its reductions, whose read-back would hold both in
registers). Every chunk folds them in by the same steps, wherever they were loaded, so its bits
do not depend on which program runs it.

Top-k, from the same read. With ``top_k``, the chunk kernel is compiled with the top-k step
(``TOPK``) and the plan is the same: the partials, and so the logprobs and ranks, have the same
bits as a call without top-k. Each program keeps, per 16-byte line, the maximum over its blocks
(the line maxima the online sum keeps anyway), and after its chunks finds their best ``k_pad``
keys (orderable float bits, then the inverted column: larger value first, then lower id) by a
threshold from those maxima and a read-back of only the vectors that can pass it
(:mod:`._logprob_topk_jit` describes the filter and its exact fallbacks), at its first chunk's
slot (unsorted when no more than ``k_pad`` keys pass the filter: then they need no selection);
the combine kernel reads only those slots (``group`` tells it where) and keeps the row's best
``k_pad`` of its programs' keys, sorted. Selection by a total order does not depend on
the order of evaluation or on which program held which chunk, so top-k is batch-invariant too.

The greedy token, from the same read (``ARGMAX``, a call with an argmax output). Each chunk
also keeps, per 16-byte line, its maximum (never NaN: maxNum), the block where it was first
reached and, for a row whose id is negative (greedy), the count of the logits equal to it
instead of the count against a token (on the element path a row takes the greedy or the
scored form of the block loop by its own id; the fused bfloat16 path selects per line). At the
chunk's end the lines that reach the chunk's maximum read back their one vector at that block to
find the lowest column; the combine kernel keeps the largest
maximum, the lowest column among the chunks that hold it and, for a greedy row, the sum of
their ties as the rank and ``max - lse`` as the logprob (the bits a call with that id gets).
Maximum, lowest column and a sum of integer counts do not depend on the order of evaluation,
so the argmax is batch-invariant as well.

Special values fall out of the arithmetic (the host documents them as the contract): NaN or
``+inf`` in a row makes its sum NaN; ``-inf`` adds nothing; a row of only ``-inf`` has
``lse = -inf`` and NaN logprobs; a token id outside ``[0, vocab)`` gives NaN and rank -1.

One kernel where the rows fit at once (``CLUSTER``, sm_90 and later, no top-k). When a call has
no more rows than the device holds clusters of a row's programs at once, the chunk kernel is
launched with each row's programs as one thread-block cluster: each program stores its
partials and arrives at the cluster's barrier (release), and the row's first program waits
there (acquire) and merges the row by :func:`merge_row`, the combine kernel's own code, reading
the partials from L2. No second kernel and no atomics; which kernel merges a row changes no bit
of it, so the choice may follow the batch. With more rows, clusters schedule worse than loose
programs, and the two kernels run.

The host side of one call is integers only: :class:`LogprobRankArgs` (byte addresses and
sizes) and :class:`LogprobRankDtypes` (element type names); :func:`launch_logprob_rank` queues
the call's kernels on a stream, :func:`bind_logprob_rank_launch` fixes their arguments once and,
on sm_90 and later, queues them as programmatic dependent launches: the chunk kernel's programs
are scheduled while the kernel before it on the stream ends and wait for it
(``griddepcontrol.wait``) before they read anything, and the combine kernel's while the chunk
kernel's last programs run; the combine kernel in turn lets the next kernel's programs be
scheduled before it waits. A row's partials are loaded once for the merge (a plan cuts a row
into at most 256 chunks).
This module is the op's host side (plan, workspace, launch on integers); its ``@triton.jit``
kernels and device helpers are in :mod:`._logprob_rank_jit`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ._logprob_rank_jit import logprob_rank_chunk_kernel, logprob_rank_combine_kernel, merge_row

__all__ = [
    "logprob_rank_chunk_kernel",
    "logprob_rank_combine_kernel",
    "merge_row",
    "LogprobRankPlan",
    "LogprobRankArgs",
    "LogprobRankDtypes",
    "plan_logprob_rank",
    "workspace_layout",
    "launch_specs",
    "launch_logprob_rank",
    "bind_logprob_rank_launch",
    "cluster_merge",
    "TOPK_MAX",
]

LOGPROB_MIN_BLOCK = 128
# Without top-k (the common call) a row is cut into about LOGPROB_CHUNKS chunks of whole blocks
# of LOGPROB_BLOCK logits, fixed by the vocabulary (151,936: 13 chunks of 6 blocks of 2048); a
# program of LOGPROB_CHUNK_WARPS warps streams the blocks of ``group`` consecutive chunks
# (:func:`_chunk_group`, from the batch: where to run a chunk, never how to sum it), keeping a
# running maximum and sum per 16-byte line of the block inside each thread (no shuffles or
# barriers per block), and reduces across its lines at the end of each chunk.
# bench/logprob_tuning.py, H200, 2026-12-02, bf16 vocab 151,936, device time p50 (one program per
# chunk): the former 10 chunks of 4 x 4096 at 16 warps 6.33 / 14.0 / 31.8 / 402 us at batch
# 1 / 64 / 256 / 4096; 19 chunks of 4 x 2048 at 4 warps 5.74 / 12.7 / 28.2 / 339 us; 10 chunks of
# 8 x 2048 27.5 us at 256 and 305 us at 4096 but 6.65 us at 1; 5 chunks of 16 x 2048 291 us at
# 4096 but 8.34 at 1: more logits per program pays at large batches (a program's launch and the
# token's two dependent loads are paid once per program), more programs at small ones, hence the
# fine split with ``group`` chunks per program (bench/logprob_rank.py, 01:32 UTC: 5.77 / 29.4 /
# 325 us at batch 1 / 256 / 4096; each chunk of a group still ends with its own CTA-wide
# reductions). Triton's software pipelining of the block loop (cp.async, 3-4 stages) and a
# register double buffer were slower or no faster. With the fused bfloat16 path, the token handed
# to a one-warp combine kernel and that kernel launched as a programmatic dependent launch
# (bench/logprob_tuning.py, 03:06 UTC): 4 / 6 / 8 blocks per chunk 4.89 / 5.24 / 5.69 us at batch
# 1, 25.3 / 25.3 / 25.5 at 256, 293.4 / 286.7 / 285.7 at 4096: hence 13 chunks of 6 blocks.
LOGPROB_BLOCK = 2048
LOGPROB_CHUNK_WARPS = 4
LOGPROB_CHUNKS = 13
# A vocabulary that is not a multiple of LOGPROB_ALIGN_LOGITS (16 bytes of 2-byte logits), such as
# GPT-2's 50,257, leaves the rows of a contiguous batch unaligned, and those take the shifted
# loads (SHIFT), which cost more per chunk: its rows are cut into chunks of at least
# LOGPROB_UNALIGNED_CHUNK_BLOCKS blocks (a function of the vocabulary still, so rows in any layout
# and of any dtype share the plan). bench/logprob_tuning.py --vocabs, H200, 2026-12-03 06:49 and
# 07:07 UTC (results/logprob_tuning_vocabs_survey.json, _shift.json), device time p50 at batch
# 1 / 64 / 256 / 4096 and top-k 20 at 256, 50,257 logits in chunks of 2 blocks (the former plan)
# against 4: bfloat16 rows contiguous 3.41 / 8.18 / 16.26 / 160.78 / 25.48 us against 3.76 /
# 8.05 / 13.36 / 139.24 / 25.42; float32 contiguous 3.54 / 9.56 / 23.30 / 265.01 / 42.67
# against 4.32 / 8.37 / 21.01 / 233.62 / 39.04; bfloat16 rows in a padded, aligned stride 3.04 /
# 5.88 / 11.73 / 111.91 / 21.02 against 3.30 / 5.97 / 10.77 / 103.75 / 20.29 (chunks of 3:
# 14.55 / 147.41 us contiguous at 256 / 4096, 6.66 us aligned at 64). 10,001 logits (5 blocks),
# one chunk per block against chunks of 3: 3.47 / 5.31 / 8.52 / 58.44 / 18.38 against 3.51 /
# 4.64 / 7.64 / 40.84 / 15.21. Aligned vocabularies keep the plan above: 32,000 in chunks of 3
# instead of 2 was slower (5.84 against 5.58 us at 64, top-k 19.45 against 16.90), and at
# 32,768, 128,256, 151,936 and 262,144 no other chunk size was faster at every batch.
LOGPROB_ALIGN_LOGITS = 8
LOGPROB_UNALIGNED_CHUNK_BLOCKS = 4
# bfloat16 rows without a temperature take the fused path (_logprob_words_jit): whole
# blocks read as 32-bit words of two logits, one fused multiply-add per exponent, the rank
# counted with one packed compare per word: 229 instead of 342 instructions per 32 logits in the
# block loop (sm_90 SASS, Triton 3.9), 48 registers instead of 54. bench/logprob_tuning.py,
# H200, 2026-12-02 02:46 UTC, bf16 device time p50, fast path vs element path side by side (19
# chunks of 4 blocks then): 5.98 / 5.96 us at batch 1, 12.98 / 13.34 at 64, 27.43 / 29.10 at
# 256, 314.5 / 327.5 at 4096 (less than the instruction count suggests: the loop is mostly
# waiting on loads). Rows that are not 16-byte aligned took the element path until they too
# took the fused path with each line's words shifted into place (SHIFT): 64 instead of 123
# registers per thread in its chunk kernel, and with top-k 20 24 instead of 1,048 bytes of
# spills (sm_90 SASS, Triton 3.6).
LOGPROB_WORDS = True
# Chunks per program: the largest of LOGPROB_GROUPS that leaves at least LOGPROB_MIN_PROGRAMS
# programs in the grid (about 1.7 waves on an H200's 132 SMs at 9 programs per SM, the occupancy
# ncu reported for 56 registers per thread).
LOGPROB_GROUPS = (4, 2, 1)
LOGPROB_MIN_PROGRAMS = 2048
# With top-k, the same plan and the top-k step after each program's chunks
# (_logprob_topk_jit): the threshold from LOGPROB_TOPK_SEL group maxima (one per thread of a
# 4-warp program), then at most 4 * k_pad candidate vectors (read back LOGPROB_TOPK_PAIRS at a
# time) and 2 * k_pad candidate logits kept; the fallbacks read back LOGPROB_TOPK_RESCAN logits per
# step, or merge LOGPROB_TOPK_PIECE at a time.
LOGPROB_TOPK_SEL = 128
# Candidate vectors per read-back step: bench/logprob_tuning.py --groups, H200, 2026-12-02 16:13-16:14
# UTC (results/logprob_tuning_topk_combine.json, _topk_pairs.json), top-k 20 at batch 256, device
# time p50: 16 / 32 / 64 vectors 37.45 / 35.25 / 35.56 us (the plain call 23.24-23.27 beside them);
# 64 or 256 group maxima instead of 128 36.22 / 36.19 against 35.23 (_topk_sel.json).
LOGPROB_TOPK_PAIRS = 32
# The top-k chunk kernel's registers per thread, capped (ptxas .maxnreg; 0: uncapped), and its
# chunks per program: LOGPROB_TOPK_GROUPS as LOGPROB_GROUPS, at least LOGPROB_TOPK_MIN_PROGRAMS.
# bench/logprob_tuning.py --topk-only, H200, 2026-12-02, top-k 20 bf16, device time p50 at batch
# 256 / 4096 (plain call 25.5 / 291.8 us): cap 64 with 2 chunks per program 46.8 / 496.0 us;
# uncapped (85 registers under Triton 3.6, so 5 programs per SM instead of 8) 51.4 / 570.4; cap 72
# 47.5 / 500.2; cap 56 54.9 / 569.5 and 48 61.6 / 645.8 (spills in the block loop); one chunk per
# program 50.9 / 601.2; four 169.4 / 558.4. Reading back every block of each candidate line instead
# of its one vector (the first version): 57.3 / 576.6 (uncapped).
LOGPROB_TOPK_MAXNREG = 64
LOGPROB_TOPK_GROUPS = (2, 1)
LOGPROB_TOPK_MIN_PROGRAMS = 1024
# With out_argmax the chunk kernel is left uncapped: the greedy tracking (per line: the block of
# its maximum and the ties at it) raises its registers from 48 to 56 (bfloat16) and from 56 to 72
# (float32) in sm_90 SASS compiled with Triton 3.9, but bench/logprob_tuning.py --argmax-only
# (H200, 2026-12-02 08:29 and 08:34 UTC, the cap passed as plan_logprob_rank(maxnreg=)) found
# float32 capped at 64 slower: 57.2 against 52.7 us at batch 256, 726 against 658 at 4096.
LOGPROB_TOPK_RESCAN = 512
# Whether a program's top-k keys are sorted when they are no more than k_pad (then they need no
# selection; the combine kernel sorts every program's keys anyway). Same run as LOGPROB_EVICT_FIRST
# (without it), sorted / unsorted: top-k 20 at batch 256 37.91 / 36.80 us, at 4096 440.1 / 423.4.
LOGPROB_TOPK_SORTED = False
LOGPROB_TOPK_PIECE = 256
TOPK_MAX = 64
# The most chunks a plan may cut a row into (the combine kernel holds a row's partials in one
# tile of registers), and top-k keys per merge step.
COMBINE_BLOCK = 256
COMBINE_KEYS = 1024
COMBINE_NUM_WARPS = 4
# Without top-k the combine kernel merges a row's few partials (13 at vocabulary 151,936) in one
# warp: shuffles only, no CTA-wide barriers. Its rare re-sum of flagged chunks reads one 16-byte
# vector per thread per step (47 registers without that path, 70 with it; 118 at two vectors).
COMBINE_CHUNK_WARPS = 1
# Bound launches queue the combine kernel as a programmatic dependent launch of the first kernel
# (sm_90+): its programs are scheduled while the first kernel's last programs run.
LOGPROB_PDL = True
# Bound launches also queue the chunk kernel as a programmatic dependent launch of whatever kernel
# precedes it on the stream: its programs are scheduled while that kernel ends and wait for it
# (griddepcontrol.wait) before they read anything; the combine kernel lets the next kernel start
# early in turn (LOGPROB_COMBINE_RELEASE_FIRST). bench/logprob_tuning.py --latency, H200, 2026-12-02 09:41 UTC, device time p50
# without / with: bf16 5.42 / 4.63 us at batch 1, 25.63 / 24.43 at 256, 293.5 / 292.3 at 4096;
# top-k 20 47.26 / 45.34 at 256; float32 42.99 / 41.32 at 256; argmax=True 30.71 / 29.23 at 256.
# In the same run unrolling the block loops by 1, 3 or 4 instead of 2 was slower or no faster.
LOGPROB_PDL_CHAIN = True
# The combine kernel lets the next kernel's programs be scheduled before it waits for the chunk
# kernel (griddepcontrol.launch_dependents, then .wait; False: the other way round), so that a
# chained kernel's first programs sit ready on the SMs the chunk kernel frees and start the moment
# the combine kernel ends (they wait for it before they read anything, and it for the chunk
# kernel). bench/logprob_tuning.py --groups, H200, 2026-12-02 18:25 UTC
# (results/logprob_tuning_release.json), device time p50 without / with, side by side: bf16 batch
# 1 3.83 / 4.00 us, 256 23.22 / 22.74 and 23.20 / 22.71, 1024 74.98 / 74.72, 4096 279.36 /
# 277.72; float32 256 39.64 / 39.21; top-k 20 at 256 34.92 / 34.78; argmax=True at 256 26.92 /
# 26.51. Chunks of 8 blocks in the same run (10 per row; 22.84 / 22.38 us at 256, 277.80 /
# 275.84 at 4096) but 4.25 / 4.36 at batch 1 and top-k 20 at 256 35.34 / 35.22 (1.57x the plain
# call): not taken.
LOGPROB_COMBINE_RELEASE_FIRST = True
# Whole blocks of each chunk that the fused path loads ahead of its block loop (2 or 4): a
# program's first chunk's while the token's two dependent loads run, the next chunk's before a
# chunk's reductions. bench/logprob_tuning.py --groups, H200, 2026-12-02 11:50 UTC, 2 / 4 in one
# run (device time p50, bf16, vocabulary 151,936): 3.80 / 3.71 us at batch 1, 23.34 / 23.96 at
# 256, 286.0 / 288.5 at 4096, argmax=True at 256 29.34 / 28.01 (4: 16 more registers of words).
# The two compile to different fused multiply-adds on the GPU (logprobs 1.9e-6 apart; each
# batch-invariant).
LOGPROB_AHEAD = 2
# Rows that are not 16-byte aligned read each line's two aligned 16-byte vectors and shift its
# words into place on the element path too (float32, float16, a temperature), as on the fused
# bfloat16 path: the same bits as aligned rows, vector loads instead of a logit per load. False:
# the element path loads such rows a logit at a time (a line spans threads: other bits).
# bench/logprob_tuning.py --groups, H200, 2026-12-02 16:43 UTC (results/logprob_tuning_shift.json),
# rows of 151,936 logits at a stride of 151,937, device time p50, shifted / a logit per load:
# float32 batch 256 44.13 / 53.96 us (aligned rows 39.45), 4096 585.3 / 758.3; float16 256 28.77 /
# 64.63, 4096 364.0 / 936.7; float32 top-k 20 at 256 169.8 / 623.9 (aligned 60.9: the top-k
# chunk kernel spilled 264 bytes under its 64-register cap; see the next constant). Whole blocks
# stop at the row's last 16-byte boundary and the rest is read a logit per load, so no load reads
# past the row's end (compute-sanitizer memcheck, 2026-12-02 19:29 UTC: 0 errors; at 18:31 UTC a
# last row's partial last line read as a whole vector ran 12 bytes past its allocation). Its cost
# (bench/README.md, 19:33 against 18:37 UTC): GPT-2's 50,257 per row at batch 256 bf16 16.41
# against 15.80 us, float32 23.24 against 20.33.
LOGPROB_SHIFT_ELEMENTS = True
# The element path unrolls its block loop twice, except with top-k (without an argmax output or a
# temperature: those not measured) on float32 rows that are not aligned: there each line takes
# two vectors (8 registers) and, unrolled twice, the top-k chunk kernel spilled 264 bytes under
# its 64-register cap (104 once; sm_90 SASS). bench/logprob_tuning.py --groups, H200, 2026-12-02 17:10 UTC (results/logprob_tuning_unroll_f32.json), rows of 151,936
# float32 logits at a stride of 151,937, device time p50, once / twice: top-k 20 at batch 256
# 97.85 / 169.67 us; without top-k 45.39 / 44.17 at 256, 596.9 / 585.4 at 4096, argmax=True
# 57.03 / 52.59 at 256 (so twice there).
LOGPROB_SHIFTED_F32_TOPK_UNROLL = 1
# The chunk kernel loads its whole blocks evict-first in L1 and L2 (_logprob_common_jit.stream_load):
# speed only, the same bits either way. bench/logprob_tuning.py --groups, H200, 2026-12-02 16:10 UTC
# (results/logprob_tuning_evict.json), device time p50 without / with, side by side: bf16 batch 1
# 3.89 / 3.91 us, 256 23.55 / 23.40 and 23.51 / 23.38, 1024 77.38 / 76.63, 4096 291.2 / 287.1;
# float32 256 41.28 / 40.38, 4096 569.4 / 557.9; argmax=True at 256 27.41 / 27.04; top-k 20 at 256
# 36.80 / 35.64, at 4096 423.4 / 412.5 (the top-k read-back after a program's chunks still finds
# its vectors in L2 often enough).
LOGPROB_EVICT_FIRST = True
# Without top-k, on sm_90 and later, when a call's rows fit in one wave of clusters (no more rows
# than cuOccupancyMaxActiveClusters: 67 clusters of 13 programs on an H200), a row's programs of
# the chunk kernel are launched as one thread-block cluster (at most LOGPROB_CLUSTER_MAX: more
# than 8 CTAs is a non-portable size) and the cluster's first program merges the row once the
# others have arrived at the cluster's barrier: one kernel per call instead of two
# (cluster_merge), the same bits. bench/logprob_tuning.py --groups, H200, bf16, device time p50:
# at 23:12 UTC with clusters at every batch (results/logprob_tuning_cluster.json), clusters /
# two kernels: batch 1 3.85 / 3.96 us, 64 9.43 / 10.21, but 256 26.91 / 22.98, 1024 92.39 /
# 76.06, 4096 340.3 / 283.3, float32 at 256 46.22 / 39.77 (not profiled; a cluster can only start
# where 13 slots are free in one GPC at once). At 23:25 UTC with one wave only
# (results/logprob_tuning_cluster_wave.json): batch 1 3.84 / 3.96, 16 5.76 / 5.82, 64 9.45 /
# 10.17, float32 at 64 13.24 / 15.49, argmax=True at 64 11.59 / 12.31; 96 to 256 two kernels in
# both columns (256: 22.71 / 22.69). The same bits in every row.
LOGPROB_CLUSTER = True
LOGPROB_CLUSTER_MAX = 16


class LogprobRankPlan(NamedTuple):
    """How rows of ``vocab`` logits are cut and reduced; a function of the vocabulary (and
    ``top_k``) only, never of the batch: that is what makes the results batch-invariant.

    ``n_chunks`` chunks per row of ``chunk_blocks`` blocks of ``block`` logits, streamed by
    programs of ``num_warps`` warps (:func:`logprob_rank_chunk_kernel`; how many chunks one
    program takes is chosen at launch from the batch, :func:`_chunk_group`, and changes no bit).
    ``words``: bfloat16 rows without a temperature take the fused path. With top-k:
    ``k_pad`` (0 without top-k; 8, 32 or 64, a power of two >= top_k), ``sel`` group maxima for
    the threshold, ``cap_p`` candidate vectors and ``cap`` candidate logits kept per program;
    ``maxnreg`` caps the chunk kernel's registers (speed only).
    """

    block: int
    n_chunks: int
    num_warps: int
    chunk_blocks: int
    words: bool = True
    k_pad: int = 0
    sel: int = 1
    cap_p: int = 1
    cap: int = 1
    maxnreg: int = 0  # the chunk kernel's register cap per thread (0: the compiler's choice)


class LogprobRankArgs(NamedTuple):
    """The integers of one call: byte addresses (0 where absent) and sizes (elements)."""

    logits: int
    token_ids: int
    temperature: int  # float32 [batch], or 0 for T = 1
    logprobs: int
    ranks: int
    topk_logprobs: int  # float32 [batch, top_k], or 0
    topk_ids: int  # [batch, top_k], or 0
    workspace: int  # 16-byte aligned, workspace_layout(...)[-1] bytes
    batch: int
    vocab: int
    row_stride: int  # elements between rows (for one row: its layout's, or 0; see _layout_stride)
    top_k: int
    argmax: int = 0  # [batch] int32/int64 greedy tokens out (ARGMAX), or 0


class LogprobRankDtypes(NamedTuple):
    """Element type names: ``logits`` float32/bfloat16/float16, the rest int32/int64."""

    logits: str
    token_ids: str
    ranks: str
    topk_ids: str = "int32"
    argmax: str = "int32"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _k_pad(top_k: int) -> int:
    return 0 if top_k <= 0 else (8 if top_k <= 8 else (32 if top_k <= 32 else 64))


def plan_logprob_rank(
    vocab: int,
    itemsize: int,
    top_k: int = 0,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    chunk_blocks: int | None = None,
    words: bool | None = None,
    maxnreg: int | None = None,
) -> LogprobRankPlan:
    """The plan for rows of ``vocab`` logits of ``itemsize`` bytes (host-only, pure): rows cut
    into about :data:`LOGPROB_CHUNKS` chunks of whole blocks (of at least
    :data:`LOGPROB_UNALIGNED_CHUNK_BLOCKS` blocks where ``vocab`` is not a multiple of
    :data:`LOGPROB_ALIGN_LOGITS`), the same with and without top-k and with and without an argmax
    output, and for every dtype.

    ``block``, ``num_warps``, ``chunk_blocks``, ``words`` and ``maxnreg`` override the defaults for
    tuning (bench/logprob_tuning.py); results are batch-invariant for any fixed choice. A choice
    that cuts a row into more than :data:`COMBINE_BLOCK` chunks is refused (ValueError).
    """
    if block is None:
        block = min(LOGPROB_BLOCK, max(LOGPROB_MIN_BLOCK, _next_pow2(vocab)))
    if num_warps is None:
        num_warps = max(1, min(LOGPROB_CHUNK_WARPS, block // 512))
    n_blocks = _cdiv(vocab, block)
    if chunk_blocks is None:
        chunk_blocks = _cdiv(n_blocks, LOGPROB_CHUNKS)
        if vocab % LOGPROB_ALIGN_LOGITS:
            chunk_blocks = max(chunk_blocks, LOGPROB_UNALIGNED_CHUNK_BLOCKS)
    elif _cdiv(n_blocks, chunk_blocks) > COMBINE_BLOCK:
        raise ValueError(
            f"chunk_blocks={chunk_blocks} cuts rows of {vocab} logits into more than {COMBINE_BLOCK} "
            f"chunks of {block}-logit blocks; use chunk_blocks >= {_cdiv(n_blocks, COMBINE_BLOCK)}"
        )
    k_pad = _k_pad(top_k)
    lines = block // (16 // itemsize)
    return LogprobRankPlan(
        block,
        _cdiv(n_blocks, chunk_blocks),
        num_warps,
        chunk_blocks,
        LOGPROB_WORDS if words is None else words,
        k_pad,
        min(LOGPROB_TOPK_SEL, lines) if k_pad else 1,
        4 * k_pad or 1,
        2 * k_pad or 1,
        (LOGPROB_TOPK_MAXNREG if k_pad else 0) if maxnreg is None else maxnreg,
    )


def workspace_layout(batch: int, plan: LogprobRankPlan) -> tuple[int, ...]:
    """Byte offsets of the workspace regions (max, sum, count, top-k keys, candidate keys,
    candidate vectors, the token's logit, its validity, the greedy maximum and its column) and
    the total size: ``batch * n_chunks`` partials and one token per row, each region starting on
    16 bytes (the top-k regions are empty without top-k)."""
    parts = batch * plan.n_chunks
    k = plan.k_pad > 0
    offsets = []
    at = 0
    for nbytes in (
        4 * parts,
        4 * parts,
        4 * parts,
        8 * parts * plan.k_pad,
        8 * parts * plan.cap * k,
        4 * parts * plan.cap_p * k,
        4 * batch,
        4 * batch,
        4 * parts,
        4 * parts,
    ):
        offsets.append(at)
        at += _cdiv(nbytes, 16) * 16
    return (*offsets, at)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _chunk_group(batch: int, n_chunks: int, top_k: int = 0) -> int:
    """Consecutive chunks per program of the chunk kernel: a question of speed only (each chunk
    is summed by the same instructions whichever program runs it, and top-k is an exact set)."""
    groups, least = (
        (LOGPROB_TOPK_GROUPS, LOGPROB_TOPK_MIN_PROGRAMS) if top_k else (LOGPROB_GROUPS, LOGPROB_MIN_PROGRAMS)
    )
    for group in groups:
        if batch * _cdiv(n_chunks, group) >= least:
            return group
    return groups[-1]


def _layout_stride(args: LogprobRankArgs) -> int:
    """The row stride (elements) that decides whether rows are 16-byte aligned, which picks the
    compiled kernels (the same bits either way, unaligned rows shifted into place; with
    ``LOGPROB_SHIFT_ELEMENTS`` off the element path reduces unaligned rows in another layout and
    so gives other bits): the call's own for several rows; for one row, the larger stride its
    layout reports, else that of contiguous rows of the vocabulary. A row alone thus takes the
    kernels of the same rows in a contiguous batch: with 50,257 float32 logits per row (not a
    multiple of 16 bytes) both take the unaligned ones."""
    return args.row_stride if args.batch > 1 or args.row_stride >= args.vocab else args.vocab


def launch_specs(
    args: LogprobRankArgs,
    dtypes: LogprobRankDtypes,
    plan: LogprobRankPlan | None = None,
    group: int | None = None,
    cluster: bool = False,
):
    """The launches of one call, as plain data, in order:
    ``(jit kernel, grid, pointers, pointer dtypes, ints, constexprs, num_warps)``: the chunk
    kernel, then the combine kernel. ``group`` overrides :func:`_chunk_group` (tuning, tests).
    ``cluster`` (no top-k; sm_90+, see :func:`cluster_merge`): the chunk kernel alone, compiled
    to merge each row in its first program, to be launched with a row's programs as one
    cluster (``(1, grid[1], 1)``)."""
    itemsize = _ITEMSIZE[dtypes.logits]
    if plan is None:
        plan = plan_logprob_rank(args.vocab, itemsize, args.top_k)
    off_m, off_s, off_c, off_k, off_cand, off_pairs, off_ty, off_tok, off_am, off_a, _ = workspace_layout(
        args.batch, plan
    )
    ws = args.workspace
    has_temp = args.temperature != 0
    temp = args.temperature if has_temp else ws + off_m  # never read without a temperature
    aligned = args.logits % 16 == 0 and (_layout_stride(args) * itemsize) % 16 == 0
    tok = (ws + off_ty, ws + off_tok)
    part_k = ws + off_k if plan.k_pad else ws + off_m  # never read without top-k
    topk_ws = (ws + off_cand, ws + off_pairs) if plan.k_pad else (ws + off_m, ws + off_m)
    has_argmax = args.argmax != 0
    greedy_ws = (ws + off_am, ws + off_a)  # written and read only with ARGMAX
    argmax_out = (args.argmax, dtypes.argmax) if has_argmax else (args.ranks, dtypes.ranks)  # never written without
    cluster = cluster and not plan.k_pad
    chunk_ptrs = (
        (args.logits, args.token_ids, temp, ws + off_m, ws + off_s, ws + off_c)
        + tok
        + (part_k,)
        + topk_ws
        + greedy_ws
        + (args.logprobs, args.ranks, argmax_out[0])
    )
    chunk_dtypes = (
        dtypes.logits,
        dtypes.token_ids,
        "float32",
        "float32",
        "float32",
        "int32",
        "float32",
        "int32",
        "int64",
        "int64",
        "int32",
        "float32",
        "int32",
        "float32",
        dtypes.ranks,
        argmax_out[1],
    )
    if group is None:
        group = _chunk_group(args.batch, plan.n_chunks, plan.k_pad)
    chunk_ints = (args.vocab, args.row_stride, plan.chunk_blocks, plan.n_chunks, group, args.top_k)
    words = plan.words and dtypes.logits == "bfloat16" and not has_temp
    chunk_const = {
        "BLOCK": plan.block,
        "VEC": 16 // itemsize,
        "ALIGNED": aligned,
        "HAS_TEMP": has_temp,
        "WORDS": words,
        "SHIFT": not aligned and (words or LOGPROB_SHIFT_ELEMENTS),
        "PACKED_COUNT": words and 4 * plan.chunk_blocks < 1 << 16,
        "GDC": False,
        "TOPK": plan.k_pad,
        "SEL": plan.sel,
        "CAP_P": plan.cap_p,
        "PAIRS": min(LOGPROB_TOPK_PAIRS, plan.cap_p),
        "CAP": plan.cap,
        "RESCAN": LOGPROB_TOPK_RESCAN,
        "PIECE": max(LOGPROB_TOPK_PIECE, plan.k_pad),
        "ARGMAX": has_argmax,
        "AHEAD": LOGPROB_AHEAD,
        "EVICT_FIRST": LOGPROB_EVICT_FIRST,
        "TOPK_SORTED": LOGPROB_TOPK_SORTED,
        "UNROLL": (
            LOGPROB_SHIFTED_F32_TOPK_UNROLL
            if itemsize == 4 and not aligned and plan.k_pad and not has_argmax and not has_temp
            else 2
        ),
        "CLUSTER": cluster,
        "MERGE_BLOCK": _next_pow2(max(plan.n_chunks, 2)),
        "RESUM_BLOCK": 32 * COMBINE_CHUNK_WARPS * (16 // itemsize),
    }
    chunk_grid = (args.batch, _cdiv(plan.n_chunks, group), 1)
    if cluster:
        return [
            (logprob_rank_chunk_kernel, chunk_grid, chunk_ptrs, chunk_dtypes, chunk_ints, chunk_const, plan.num_warps)
        ]
    if plan.k_pad:
        comb_out = (args.topk_logprobs, args.topk_ids)
        comb_out_dtypes = ("float32", dtypes.topk_ids)
    else:  # never written without top-k
        comb_out, comb_out_dtypes = (args.logprobs, args.ranks), ("float32", dtypes.ranks)
    comb_ptrs = (
        (args.logits, args.logprobs, args.ranks)
        + comb_out
        + (ws + off_m, ws + off_s, ws + off_c, part_k)
        + tok
        + (argmax_out[0],)
        + greedy_ws
    )
    comb_dtypes = (
        (dtypes.logits, "float32", dtypes.ranks)
        + comb_out_dtypes
        + ("float32", "float32", "int32", "int64", "float32", "int32", argmax_out[1], "float32", "int32")
    )
    comb_warps = COMBINE_NUM_WARPS if plan.k_pad else COMBINE_CHUNK_WARPS
    comb_const = {
        "BLOCK": _next_pow2(max(plan.n_chunks, 2)),
        "K_PAD": plan.k_pad,
        # with top-k, the key sets of a row's programs at the largest top-k group in one
        # merge step (a row of more programs takes more steps)
        "KEY_TILES": min(
            _next_pow2(max(_cdiv(plan.n_chunks, max(LOGPROB_TOPK_GROUPS)), 2)),
            max(2, COMBINE_KEYS // max(plan.k_pad, 1)),
        ),
        "RESUM": words,
        "RESUM_BLOCK": 32 * comb_warps * (16 // itemsize),
        "VEC": 16 // itemsize,
        "GDC": False,
        "ARGMAX": has_argmax,
        "RELEASE_FIRST": LOGPROB_COMBINE_RELEASE_FIRST,
    }
    comb_ints = (args.vocab, args.row_stride, plan.n_chunks, args.top_k, plan.chunk_blocks * plan.block, group)
    return [
        (logprob_rank_chunk_kernel, chunk_grid, chunk_ptrs, chunk_dtypes, chunk_ints, chunk_const, plan.num_warps),
        (logprob_rank_combine_kernel, (args.batch, 1, 1), comb_ptrs, comb_dtypes, comb_ints, comb_const, comb_warps),
    ]


def cluster_merge(plan: LogprobRankPlan, device_id: int) -> bool:
    """Whether calls of ``plan`` on ``device_id`` may merge each row inside the chunk kernel, a
    row's programs launched as one cluster (:data:`LOGPROB_CLUSTER`), instead of in a second
    kernel: sm_90 and later, no top-k, a row's chunks no more than :data:`LOGPROB_CLUSTER_MAX`.
    A call takes that form when its rows' clusters all fit on the device at once
    (:func:`_compiled_launches`); which kernel merges a row changes no bit of it (the merge is
    the same code, :func:`merge_row`, over a row's few partials, which fit in one warp either
    way; ``test_gpu_batch_invariant_bitwise`` compares the bits across batches that take both
    forms)."""
    from .._cuda import compute_capability

    return (
        LOGPROB_CLUSTER
        and not plan.k_pad
        and plan.n_chunks <= LOGPROB_CLUSTER_MAX
        and compute_capability(device_id) >= (9, 0)
    )


def _compiled_launches(args, dtypes, device_id, plan, group=None):
    """``(compiled kernel, grid, pointers, ints, pdl allowed, cluster dims or None)`` per launch."""
    from .._cuda import compute_capability
    from ._compiled import compiled

    if plan is None:
        plan = plan_logprob_rank(args.vocab, _ITEMSIZE[dtypes.logits], args.top_k)
    gdc = LOGPROB_PDL and compute_capability(device_id) >= (9, 0)

    def build(cluster):
        return [
            (
                compiled(
                    kernel,
                    device_id,
                    ptr_dtypes,
                    len(ints),
                    dict(constexprs, GDC=gdc),
                    num_warps,
                    plan.maxnreg if i == 0 and plan.maxnreg else None,
                ),
                grid,
                ptrs,
                ints,
                gdc,
                (1, grid[1], 1) if cluster else None,
            )
            for i, (kernel, grid, ptrs, ptr_dtypes, ints, constexprs, num_warps) in enumerate(
                launch_specs(args, dtypes, plan, group, cluster)
            )
        ]

    if cluster_merge(plan, device_id):
        launches = build(True)
        kernel, grid, *_, dims = launches[0]
        if grid[0] <= kernel.max_active_clusters(grid, dims):
            return launches
        # More rows than clusters the device holds at once (or none fits): the two kernels, the
        # same merge (the same bits).
    return build(False)


def launch_logprob_rank(
    args: LogprobRankArgs,
    dtypes: LogprobRankDtypes,
    device_id: int,
    stream: int,
    plan: LogprobRankPlan | None = None,
    group: int | None = None,
) -> None:
    """Queue the call's kernels on ``stream`` (stream-ordered, never blocking; the first call per
    device and signature compiles, host-blocking). The current CUDA context must be that of
    ``device_id``. ``plan`` and ``group`` override the defaults (tuning)."""
    for kernel, grid, ptrs, ints, _, cluster in _compiled_launches(args, dtypes, device_id, plan, group):
        if cluster is None:
            kernel.launch(grid, stream, *ptrs, *ints)
        else:
            kernel.bind(grid, *ptrs, *ints, cluster=cluster)(stream)


def bind_logprob_rank_launch(
    args: LogprobRankArgs,
    dtypes: LogprobRankDtypes,
    device_id: int,
    plan: LogprobRankPlan | None = None,
    group: int | None = None,
) -> Callable[[int], None]:
    """Return ``launch(stream)`` that queues this exact call (arguments packed once). ``plan``
    and ``group`` override the defaults (tuning)."""
    # Programmatic dependent launches where the device allows it (sm_90+): the chunk kernel of
    # the kernel before it on the stream (LOGPROB_PDL_CHAIN), the combine kernel of the chunk
    # kernel; each is scheduled early and waits on the device for the grid before it.
    launches: list[Callable[[int], None]] = [
        kernel.bind(grid, *ptrs, *ints, cluster=cluster, pdl=gdc and (i == 1 or LOGPROB_PDL_CHAIN))
        for i, (kernel, grid, ptrs, ints, gdc, cluster) in enumerate(
            _compiled_launches(args, dtypes, device_id, plan, group)
        )
    ]
    if len(launches) == 1:
        return launches[0]
    first, second = launches

    def launch(stream: int) -> None:
        first(stream)
        second(stream)

    return launch
