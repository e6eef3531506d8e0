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
(:func:`plan_logprob_rank`; 151,936 logits: 13 chunks of 6 blocks of 2048). Program ``(b, g)``
of :func:`logprob_rank_chunk_kernel` streams chunks ``g * group ...`` of row ``b`` once (``group``
consecutive chunks per program, a runtime value chosen from the batch for speed: the same
compiled kernel and the same instructions per chunk at every batch size), keeping a running
maximum and sum of exponentials per 16-byte line of the block inside each thread and a count of
``y >= y[t]``, reduces its lines in a fixed order at the end and writes the partial
``(m, s, count)``; :func:`logprob_rank_combine_kernel` merges a row's partials in chunk order
(one warp per row). The program that holds a row's first chunk (or tile) also writes the row's
token logit and whether its id is valid to the workspace, so the combine kernel reads them with
the partials instead of loading the id and then its logit (two dependent round trips less).

The bfloat16 fast path (rows 16-byte aligned, no temperature: ``WORDS``). The chunk kernel reads
whole blocks as 32-bit words of two logits (widened by a shift and a mask), computes each
exponent with one fused multiply-add against a per-line offset ``mc = clamp(m, +-2**20) *
log2(e)`` and undoes the offset's rounding at the chunk's end (``2**(mc - max * log2(e))``, one
rounding), and counts ``y >= y[t]`` with one packed ``bf16x2`` compare per word. A chunk whose
maximum is finite beyond ``+-2**20`` (a row masked with ``finfo.min`` instead of -inf, say) has
its sum flagged (-1); the combine kernel sums such a chunk again in the plain form when it lies
within 128 of the row's maximum (else it adds nothing either way). Which chunks are flagged
depends on their own logits only, so the path is as batch-invariant as the other; its bits
differ from the element path's (other dtypes) in the last places.

Batch invariance, with top-k. Each row is cut into ``n_tiles = cdiv(vocab, tile)`` tiles of ``tile`` logits,
``tile`` chosen from the vocabulary alone (:func:`plan_logprob_rank`). Program ``p`` of
:func:`logprob_rank_tile_kernel` owns tile ``p % n_tiles`` of row ``p // n_tiles``: it loads the
tile once (16-byte vectors where rows are aligned), takes its maximum ``m`` (exact in any order),
sums ``exp(y - m)`` (``tl.sum``: an order fixed by the compiled kernel, which is the same for every
batch size; or, with ``plan.tree``, a fixed binary tree over the column index bits,
:func:`_tree_sum`, the same bits whatever register layout the compiler picks), counts
``y >= y[t]`` (integers: exact) and writes the partial ``(m, s, count)``.
:func:`logprob_rank_combine_kernel` (one program per row) merges a row's partials in tile
order. Nothing depends on the batch, the row's position or the other rows: a row gives the same
bits in a batch of 1 and of 10,000 (the compiled kernels depend on the dtypes, the vocabulary,
whether rows are 16-byte aligned (a property of the layout, see :func:`_aligned`), top-k and
temperature, never on the batch). The two paths sum in different orders: a call with top-k
gives the same ranks and top-k, but logprobs that may differ in the last bits from a call
without it.

Top-k. Per tile, a cheap filter finds the candidates: ``tau`` = the ``K_PAD``-th largest of
``N_GROUPS`` group maxima, so at least ``K_PAD >= top_k`` logits are ``>= tau`` and the tile's
``top_k`` best are among them. When at most ``CAP`` logits pass (the common case; ties at ``tau``
are cut to the ``top_k`` lowest columns), their columns are compacted into the workspace, read
back (the tile is still in cache) and reduced with a bitonic top-k network on 64-bit keys
(orderable float bits, then the inverted column: larger value first, then lower id). Otherwise
the tile is re-read in pieces of ``CAP`` and merged piece by piece. Either way the tile's best
``K_PAD`` keys are exact, and selection by a total order does not depend on the order of
evaluation. The combine kernel keeps the row's best ``K_PAD`` of the ``n_tiles * K_PAD``.

Special values fall out of the arithmetic (the host documents them as the contract): NaN or
``+inf`` in a row makes its sum NaN; ``-inf`` adds nothing; a row of only ``-inf`` has
``lse = -inf`` and NaN logprobs; a token id outside ``[0, vocab)`` gives NaN and rank -1.

The host side of one call is integers only: :class:`LogprobRankArgs` (byte addresses and
sizes) and :class:`LogprobRankDtypes` (element type names); :func:`launch_logprob_rank` queues
the two kernels on a stream, :func:`bind_logprob_rank_launch` fixes their arguments once.
This module is the op's host side (plan, workspace, launch on integers); its ``@triton.jit``
kernels and device helpers are in :mod:`._logprob_rank_jit`, re-exported here.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

from ._logprob_rank_jit import logprob_rank_chunk_kernel, logprob_rank_combine_kernel, logprob_rank_tile_kernel

__all__ = [
    "logprob_rank_chunk_kernel",
    "logprob_rank_tile_kernel",
    "logprob_rank_combine_kernel",
    "LogprobRankPlan",
    "LogprobRankArgs",
    "LogprobRankDtypes",
    "plan_logprob_rank",
    "workspace_layout",
    "launch_specs",
    "launch_logprob_rank",
    "bind_logprob_rank_launch",
    "LOGPROB_TILE",
    "TOPK_MAX",
]

# With top-k, logits per program: a row of 151,936 is 19 tiles of 8192 (16 KiB of bf16 per
# program, 8 warps, 32 logits per thread); smaller vocabularies get the next power of two.
# bench/logprob_tuning.py, H200, 2026-12-02, top-k 20 at batch 256 bf16, device time p50 in two
# runs: 8192 x 8 warps 355 / 356 us, 4096 x 4 447 / 448 us, 8192 x 16 401 us, 16384 x 16 1,238 us.
LOGPROB_TILE = 8192
LOGPROB_MIN_TILE = 128
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
# Aligned bfloat16 rows without a temperature take _chunk_fast: whole blocks read as 32-bit words
# of two logits, one fused multiply-add per exponent, the rank counted with one packed compare
# per word: 229 instead of 342 instructions per 32 logits in the block loop (sm_90 SASS, Triton
# 3.9), 48 registers instead of 54. bench/logprob_tuning.py, H200, 2026-12-02 02:46 UTC, bf16
# device time p50, fast path vs element path side by side (19 chunks of 4 blocks then): 5.98 /
# 5.96 us at batch 1, 12.98 / 13.34 at 64, 27.43 / 29.10 at 256, 314.5 / 327.5 at 4096 (less than
# the instruction count suggests: the loop is mostly waiting on loads).
LOGPROB_WORDS = True
# Chunks per program: the largest of LOGPROB_GROUPS that leaves at least LOGPROB_MIN_PROGRAMS
# programs in the grid (about 1.7 waves on an H200's 132 SMs at 9 programs per SM, the occupancy
# ncu reported for 56 registers per thread).
LOGPROB_GROUPS = (4, 2, 1)
LOGPROB_MIN_PROGRAMS = 2048
LOGPROB_ELEMENTS_PER_THREAD = 32
LOGPROB_MAX_WARPS = 8
# Sum a tile with tl.sum (False) or in the fixed tree of _tree_sum (True). Both are batch-invariant
# (one compiled kernel serves every batch size); the tree also gives the same bits across compiled
# variants (aligned or not, with or without top-k), but cost 64.7 vs 54.5 us at batch 256 bf16 and
# 914 vs 742 us at batch 4096 in the run above.
LOGPROB_TREE = False
TOPK_MAX = 64
# Partials the combine kernel merges per loop step, and top-k keys per merge step.
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


class LogprobRankPlan(NamedTuple):
    """How rows of ``vocab`` logits are cut and reduced; a function of the vocabulary (and
    ``top_k``) only, never of the batch: that is what makes the results batch-invariant.

    With top-k: ``tile`` logits per program (a power of two), ``n_tiles`` programs per row,
    ``num_warps`` per program. Without top-k: ``n_tiles`` chunks per row of ``chunk_blocks``
    blocks of ``tile`` logits, streamed by programs of ``num_warps`` warps
    (:func:`logprob_rank_chunk_kernel`; how many chunks one program takes is chosen at launch from
    the batch, :func:`_chunk_group`, and changes no bit). ``high_bits``: index bits the tree sum
    folds first (bits above one register pass of the CTA); top-k: ``k_pad`` (0 without top-k; a
    power of two >= top_k), ``n_groups``
    group maxima for the filter, ``cap`` candidates kept per tile; ``tree`` sums tiles in the
    fixed tree of ``_tree_sum`` instead of ``tl.sum`` (default ``LOGPROB_TREE``).
    """
    tile: int
    n_tiles: int
    num_warps: int
    high_bits: int
    k_pad: int
    n_groups: int
    cap: int
    tree: bool
    chunk_blocks: int = 0      # without top-k: blocks of ``tile`` logits per program (0 with top-k)
    words: bool = True         # without top-k: aligned bfloat16 rows without a temperature take the fused path


class LogprobRankArgs(NamedTuple):
    """The integers of one call: byte addresses (0 where absent) and sizes (elements)."""
    logits: int
    token_ids: int
    temperature: int      # float32 [batch], or 0 for T = 1
    logprobs: int
    ranks: int
    topk_logprobs: int    # float32 [batch, top_k], or 0
    topk_ids: int         # [batch, top_k], or 0
    workspace: int        # 16-byte aligned, workspace_layout(...)[-1] bytes
    batch: int
    vocab: int
    row_stride: int       # elements between rows (0 for one row)
    top_k: int


class LogprobRankDtypes(NamedTuple):
    """Element type names: ``logits`` float32/bfloat16/float16, the rest int32/int64."""
    logits: str
    token_ids: str
    ranks: str
    topk_ids: str = "int32"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _k_pad(top_k: int) -> int:
    return 0 if top_k <= 0 else (8 if top_k <= 8 else (32 if top_k <= 32 else 64))


def _plan_chunks(vocab: int, *, block: Optional[int], num_warps: Optional[int],
                 chunk_blocks: Optional[int], words: Optional[bool]) -> LogprobRankPlan:
    """Without top-k: rows cut into about :data:`LOGPROB_CHUNKS` chunks of whole blocks."""
    if block is None:
        block = min(LOGPROB_BLOCK, max(LOGPROB_MIN_TILE, _next_pow2(vocab)))
    if num_warps is None:
        num_warps = max(1, min(LOGPROB_CHUNK_WARPS, block // 512))
    n_blocks = _cdiv(vocab, block)
    if chunk_blocks is None:
        chunk_blocks = _cdiv(n_blocks, LOGPROB_CHUNKS)
    return LogprobRankPlan(block, _cdiv(n_blocks, chunk_blocks), num_warps, 0, 0, 0, 0, False, chunk_blocks,
                           LOGPROB_WORDS if words is None else words)


def plan_logprob_rank(vocab: int, itemsize: int, top_k: int = 0, *, tile: Optional[int] = None,
                      num_warps: Optional[int] = None, tree: Optional[bool] = None,
                      chunk_blocks: Optional[int] = None, words: Optional[bool] = None) -> LogprobRankPlan:
    """The plan for rows of ``vocab`` logits of ``itemsize`` bytes (host-only, pure).

    ``tile``, ``num_warps``, ``tree`` and (without top-k) ``chunk_blocks`` and ``words`` override
    the defaults for tuning (bench/logprob_tuning.py); results are batch-invariant for any fixed
    choice.
    """
    if top_k <= 0:
        return _plan_chunks(vocab, block=tile, num_warps=num_warps, chunk_blocks=chunk_blocks, words=words)
    if tile is None:
        tile = min(LOGPROB_TILE, max(LOGPROB_MIN_TILE, _next_pow2(vocab)))
    if tree is None:
        tree = LOGPROB_TREE
    if num_warps is None:
        num_warps = max(1, min(LOGPROB_MAX_WARPS, tile // (32 * LOGPROB_ELEMENTS_PER_THREAD)))
    vec = 16 // itemsize
    pass_elems = vec * 32 * num_warps
    high_bits = max(0, (tile // pass_elems).bit_length() - 1) if tile > pass_elems else 0
    k_pad = _k_pad(top_k)
    n_groups = min(4 * k_pad, tile // 2)
    cap = 2 * k_pad
    return LogprobRankPlan(tile, _cdiv(vocab, tile), num_warps, high_bits, k_pad, n_groups, cap, tree)


def workspace_layout(batch: int, plan: LogprobRankPlan) -> Tuple[int, int, int, int, int, int, int, int]:
    """Byte offsets of the workspace regions (max, sum, count, top-k keys, candidates, the
    token's logit, its validity) and the total size. ``batch * n_tiles`` partials and one token
    per row; each region starts on 16 bytes."""
    parts = batch * plan.n_tiles
    offsets = []
    at = 0
    for nbytes in (4 * parts, 4 * parts, 4 * parts, 8 * parts * plan.k_pad, 4 * parts * plan.cap, 4 * batch,
                   4 * batch):
        offsets.append(at)
        at += _cdiv(nbytes, 16) * 16
    return (*offsets, at)


def _aligned(args: LogprobRankArgs, itemsize: int, plan: LogprobRankPlan) -> bool:
    """Whether every row starts on 16 bytes (vector loads). Only speed depends on it when the
    plan sums in trees; otherwise it is a property of the layout, never of the batch."""
    if args.logits % 16:
        return False
    stride_ok = (args.row_stride * itemsize) % 16 == 0
    return stride_ok or (args.batch == 1 and plan.tree)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def launch_specs(args: LogprobRankArgs, dtypes: LogprobRankDtypes, plan: Optional[LogprobRankPlan] = None):
    """The two launches of one call, as plain data, in order:
    ``(jit kernel, grid, pointers, pointer dtypes, ints, constexprs, num_warps)``."""
    itemsize = _ITEMSIZE[dtypes.logits]
    if plan is None:
        plan = plan_logprob_rank(args.vocab, itemsize, args.top_k)
    if plan.k_pad == 0:
        return _chunk_specs(args, dtypes, plan, itemsize)
    # With top-k (plan.k_pad > 0): the tile kernel, then the combine kernel.
    off_m, off_s, off_c, off_k, off_cand, off_ty, off_tok, _ = workspace_layout(args.batch, plan)
    ws = args.workspace
    has_temp = args.temperature != 0
    temp = args.temperature if has_temp else ws + off_m           # never read without a temperature
    part_k = ws + off_k
    tok = (ws + off_ty, ws + off_tok)
    tile_ptrs = (args.logits, args.token_ids, temp, ws + off_m, ws + off_s, ws + off_c, part_k, ws + off_cand) + tok
    tile_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", "float32", "int32", "int64", "int32",
                   "float32", "int32")
    tile_ints = (args.vocab, args.row_stride, plan.n_tiles, args.top_k)
    log_tile = plan.tile.bit_length() - 1
    tile_const = {"TILE": plan.tile, "LOG_TILE": log_tile, "HIGH_BITS": plan.high_bits,
                  "ALIGNED": _aligned(args, itemsize, plan), "HAS_TEMP": has_temp, "K_PAD": plan.k_pad,
                  "N_GROUPS": max(plan.n_groups, 2), "CAP": plan.cap, "TREE": plan.tree, "GDC": False}
    comb_ptrs = (args.logits, args.logprobs, args.ranks, args.topk_logprobs, args.topk_ids,
                 ws + off_m, ws + off_s, ws + off_c, part_k) + tok
    comb_dtypes = (dtypes.logits, "float32", dtypes.ranks, "float32", dtypes.topk_ids,
                   "float32", "float32", "int32", "int64", "float32", "int32")
    block = min(COMBINE_BLOCK, _next_pow2(max(plan.n_tiles, 2)))
    key_tiles = min(_next_pow2(max(plan.n_tiles, 2)), max(2, COMBINE_KEYS // plan.k_pad))
    comb_const = {"BLOCK": block, "LOG_BLOCK": block.bit_length() - 1,
                  "K_PAD": plan.k_pad, "KEY_TILES": key_tiles, "TREE": plan.tree, "RESUM": False,
                  "RESUM_BLOCK": plan.tile, "VEC": 16 // itemsize, "GDC": False}
    return [
        (logprob_rank_tile_kernel, (args.batch * plan.n_tiles, 1, 1), tile_ptrs, tile_dtypes, tile_ints,
         tile_const, plan.num_warps),
        (logprob_rank_combine_kernel, (args.batch, 1, 1), comb_ptrs, comb_dtypes, tile_ints + (0,), comb_const,
         COMBINE_NUM_WARPS),
    ]


def _chunk_group(batch: int, n_chunks: int) -> int:
    """Consecutive chunks per program of the chunk kernel: a question of speed only (each chunk
    is summed by the same instructions whichever program runs it)."""
    for group in LOGPROB_GROUPS:
        if batch * _cdiv(n_chunks, group) >= LOGPROB_MIN_PROGRAMS:
            return group
    return LOGPROB_GROUPS[-1]


def _chunk_specs(args: LogprobRankArgs, dtypes: LogprobRankDtypes, plan: LogprobRankPlan, itemsize: int):
    """The two launches without top-k: the chunk kernel, then the combine kernel."""
    off_m, off_s, off_c, _, _, off_ty, off_tok, _ = workspace_layout(args.batch, plan)
    ws = args.workspace
    has_temp = args.temperature != 0
    temp = args.temperature if has_temp else ws + off_m           # never read without a temperature
    aligned = args.logits % 16 == 0 and (args.batch <= 1 or (args.row_stride * itemsize) % 16 == 0)
    tok = (ws + off_ty, ws + off_tok)
    chunk_ptrs = (args.logits, args.token_ids, temp, ws + off_m, ws + off_s, ws + off_c) + tok
    chunk_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", "float32", "int32", "float32", "int32")
    group = _chunk_group(args.batch, plan.n_tiles)
    chunk_ints = (args.vocab, args.row_stride, plan.chunk_blocks, plan.n_tiles, group)
    words = plan.words and aligned and dtypes.logits == "bfloat16" and not has_temp
    chunk_const = {"BLOCK": plan.tile, "VEC": 16 // itemsize, "ALIGNED": aligned, "HAS_TEMP": has_temp,
                   "WORDS": words, "PACKED_COUNT": words and 4 * plan.chunk_blocks < 1 << 16, "GDC": False}
    comb_ptrs = (args.logits, args.logprobs, args.ranks, args.logprobs, args.ranks,
                 ws + off_m, ws + off_s, ws + off_c, ws + off_m) + tok
    comb_dtypes = (dtypes.logits, "float32", dtypes.ranks, "float32", dtypes.ranks,
                   "float32", "float32", "int32", "int64", "float32", "int32")
    block = min(COMBINE_BLOCK, _next_pow2(max(plan.n_tiles, 2)))
    comb_const = {"BLOCK": block, "LOG_BLOCK": block.bit_length() - 1, "K_PAD": 0,
                  "KEY_TILES": 2, "TREE": False, "RESUM": words,
                  "RESUM_BLOCK": 32 * COMBINE_CHUNK_WARPS * (16 // itemsize), "VEC": 16 // itemsize,
                  "GDC": False}
    return [
        (logprob_rank_chunk_kernel, (args.batch, _cdiv(plan.n_tiles, group), 1), chunk_ptrs, chunk_dtypes, chunk_ints,
         chunk_const, plan.num_warps),
        (logprob_rank_combine_kernel, (args.batch, 1, 1), comb_ptrs, comb_dtypes,
         (args.vocab, args.row_stride, plan.n_tiles, 0, plan.chunk_blocks * plan.tile), comb_const,
         COMBINE_CHUNK_WARPS),
    ]


def _compiled_launches(args, dtypes, device_id, plan):
    from .._cuda import compute_capability
    from ._compiled import compiled
    gdc = LOGPROB_PDL and compute_capability(device_id) >= (9, 0)
    for kernel, grid, ptrs, ptr_dtypes, ints, constexprs, num_warps in launch_specs(args, dtypes, plan):
        constexprs = dict(constexprs, GDC=gdc)
        yield compiled(kernel, device_id, ptr_dtypes, len(ints), constexprs, num_warps), grid, ptrs, ints, gdc


def launch_logprob_rank(args: LogprobRankArgs, dtypes: LogprobRankDtypes, device_id: int, stream: int,
                        plan: Optional[LogprobRankPlan] = None) -> None:
    """Queue the call's two kernels on ``stream`` (stream-ordered, never blocking; the first
    call per device and signature compiles, host-blocking). The current CUDA context must be
    that of ``device_id``."""
    for kernel, grid, ptrs, ints, _ in _compiled_launches(args, dtypes, device_id, plan):
        kernel.launch(grid, stream, *ptrs, *ints)


def bind_logprob_rank_launch(args: LogprobRankArgs, dtypes: LogprobRankDtypes, device_id: int,
                             plan: Optional[LogprobRankPlan] = None) -> Callable[[int], None]:
    """Return ``launch(stream)`` that queues this exact call (arguments packed once)."""
    # The combine kernel (the second) as a programmatic dependent launch where the device allows
    # it: it is scheduled while the first kernel finishes and waits for its results on the device.
    launches: List[Callable[[int], None]] = [kernel.bind(grid, *ptrs, *ints, pdl=gdc and i == 1)
                                             for i, (kernel, grid, ptrs, ints, gdc)
                                             in enumerate(_compiled_launches(args, dtypes, device_id, plan))]
    first, second = launches

    def launch(stream: int) -> None:
        first(stream)
        second(stream)

    return launch
