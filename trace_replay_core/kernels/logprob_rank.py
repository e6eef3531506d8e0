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
(:func:`plan_logprob_rank`; 151,936 logits: 10 chunks of 4 blocks of 4096). Program ``(b, c)``
of :func:`logprob_rank_chunk_kernel` streams chunk ``c`` of row ``b`` once, keeping a running
maximum and sum of exponentials per 16-byte line of the block inside each thread and a count of
``y >= y[t]``, reduces its lines in a fixed order at the end and writes the partial
``(m, s, count)``; :func:`logprob_rank_combine_kernel` merges a row's partials in chunk order.

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
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import triton
import triton.language as tl

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

# Logits per program: a row of 151,936 is 38 tiles of 4096 (8 KiB of bf16 per program, 4 warps,
# 32 logits per thread); smaller vocabularies get the next power of two. bench/logprob_tuning.py
# on the H200 (2026-12-01, vocab 151,936, device time, an earlier build whose tile loads were all
# masked, i.e. not vectorised): 4096 x 4 warps against 8192 x 8 at batch 256 bf16 48.4 vs 64.7 us,
# float32 54.1 vs 72.3 us; at batch 4096 bf16 645 vs 914 us; batch 1 6.27 vs 6.56 us; 8192 x 4
# and 16384 x 8 were slower than 4096 x 4 everywhere.
LOGPROB_TILE = 4096
LOGPROB_MIN_TILE = 128
# Without top-k (the common call) a row is cut into about LOGPROB_CHUNKS chunks of whole blocks
# of LOGPROB_BLOCK logits, fixed by the vocabulary (151,936: 10 chunks of 4 blocks); each chunk is
# one program of LOGPROB_CHUNK_WARPS warps that streams its blocks, keeping a running maximum and
# sum per 16-byte line of the block inside each thread (no shuffles or barriers per block), and
# reduces across its lines once at the end. The same loop as the former batch-dependent kernel
# (26 us at batch 256 bf16, 303 us at 4096 on the H200, one program per row there), with the
# split now fixed by the vocabulary. The single-tile programs of the top-k kernel held a whole
# tile in registers and reduced it three times across the CTA: 42 us at batch 256 bf16, 545 us
# at 4096 (H200, 2026-12-01).
LOGPROB_BLOCK = 4096
LOGPROB_CHUNK_WARPS = 16
LOGPROB_CHUNKS = 10
_NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)
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
_INT64_MIN = -(2**63)

_LOG2E = tl.constexpr(1.4426950408889634)
_KEY_PAD = tl.constexpr(_INT64_MIN)


class LogprobRankPlan(NamedTuple):
    """How rows of ``vocab`` logits are cut and reduced; a function of the vocabulary (and
    ``top_k``) only, never of the batch: that is what makes the results batch-invariant.

    With top-k: ``tile`` logits per program (a power of two), ``n_tiles`` programs per row,
    ``num_warps`` per program. Without top-k: ``n_tiles`` chunks per row, each one program that
    streams ``chunk_blocks`` blocks of ``tile`` logits (:func:`logprob_rank_chunk_kernel`); ``high_bits`` index bits the tree sum folds first (bits above one register
    pass of the CTA); top-k: ``k_pad`` (0 without top-k; a power of two >= top_k), ``n_groups``
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
                 chunk_blocks: Optional[int]) -> LogprobRankPlan:
    """Without top-k: rows cut into about :data:`LOGPROB_CHUNKS` chunks of whole blocks."""
    if block is None:
        block = min(LOGPROB_BLOCK, max(LOGPROB_MIN_TILE, _next_pow2(vocab)))
    if num_warps is None:
        num_warps = max(1, min(LOGPROB_CHUNK_WARPS, block // 256))
    n_blocks = _cdiv(vocab, block)
    if chunk_blocks is None:
        chunk_blocks = _cdiv(n_blocks, LOGPROB_CHUNKS)
    return LogprobRankPlan(block, _cdiv(n_blocks, chunk_blocks), num_warps, 0, 0, 0, 0, False, chunk_blocks)


def plan_logprob_rank(vocab: int, itemsize: int, top_k: int = 0, *, tile: Optional[int] = None,
                      num_warps: Optional[int] = None, tree: Optional[bool] = None,
                      chunk_blocks: Optional[int] = None) -> LogprobRankPlan:
    """The plan for rows of ``vocab`` logits of ``itemsize`` bytes (host-only, pure).

    ``tile``, ``num_warps``, ``tree`` and (without top-k) ``chunk_blocks`` override the defaults
    for tuning (bench/logprob_tuning.py); results are batch-invariant for any fixed choice.
    """
    if top_k <= 0:
        return _plan_chunks(vocab, block=tile, num_warps=num_warps, chunk_blocks=chunk_blocks)
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
    n_groups = min(4 * k_pad, tile // 2) if k_pad else 0
    cap = 2 * k_pad
    return LogprobRankPlan(tile, _cdiv(vocab, tile), num_warps, high_bits, k_pad, n_groups, cap, tree)


def workspace_layout(batch: int, plan: LogprobRankPlan) -> Tuple[int, int, int, int, int, int]:
    """Byte offsets of the workspace regions (max, sum, count, top-k keys, candidates) and the
    total size. ``batch * n_tiles`` partials; each region starts on 16 bytes."""
    parts = batch * plan.n_tiles
    offsets = []
    at = 0
    for nbytes in (4 * parts, 4 * parts, 4 * parts, 8 * parts * plan.k_pad, 4 * parts * plan.cap):
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
    off_m, off_s, off_c, off_k, off_cand, _ = workspace_layout(args.batch, plan)
    ws = args.workspace
    has_temp = args.temperature != 0
    temp = args.temperature if has_temp else ws + off_m           # never read without a temperature
    part_k = ws + off_k if plan.k_pad else ws + off_m             # never read without top-k
    cand = ws + off_cand if plan.k_pad else ws + off_m
    topk_lp = args.topk_logprobs if plan.k_pad else args.logprobs
    topk_id = args.topk_ids if plan.k_pad else args.ranks
    tile_ptrs = (args.logits, args.token_ids, temp, ws + off_m, ws + off_s, ws + off_c, part_k, cand)
    tile_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", "float32", "int32", "int64", "int32")
    tile_ints = (args.vocab, args.row_stride, plan.n_tiles, args.top_k)
    log_tile = plan.tile.bit_length() - 1
    tile_const = {"TILE": plan.tile, "LOG_TILE": log_tile, "HIGH_BITS": plan.high_bits,
                  "ALIGNED": _aligned(args, itemsize, plan), "HAS_TEMP": has_temp, "K_PAD": plan.k_pad,
                  "N_GROUPS": max(plan.n_groups, 2), "CAP": max(plan.cap, 2), "TREE": plan.tree}
    comb_ptrs = (args.logits, args.token_ids, temp, args.logprobs, args.ranks, topk_lp, topk_id,
                 ws + off_m, ws + off_s, ws + off_c, part_k)
    topk_id_dtype = dtypes.topk_ids if plan.k_pad else dtypes.ranks
    comb_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", dtypes.ranks, "float32", topk_id_dtype,
                   "float32", "float32", "int32", "int64")
    block = min(COMBINE_BLOCK, _next_pow2(max(plan.n_tiles, 2)))
    key_tiles = min(_next_pow2(max(plan.n_tiles, 2)), max(2, COMBINE_KEYS // max(plan.k_pad, 1)))
    comb_const = {"BLOCK": block, "LOG_BLOCK": block.bit_length() - 1, "HAS_TEMP": has_temp,
                  "K_PAD": plan.k_pad, "KEY_TILES": key_tiles, "TREE": plan.tree}
    return [
        (logprob_rank_tile_kernel, (args.batch * plan.n_tiles, 1, 1), tile_ptrs, tile_dtypes, tile_ints,
         tile_const, plan.num_warps),
        (logprob_rank_combine_kernel, (args.batch, 1, 1), comb_ptrs, comb_dtypes, tile_ints, comb_const,
         COMBINE_NUM_WARPS),
    ]


def _chunk_specs(args: LogprobRankArgs, dtypes: LogprobRankDtypes, plan: LogprobRankPlan, itemsize: int):
    """The two launches without top-k: the chunk kernel, then the combine kernel."""
    off_m, off_s, off_c, _, _, _ = workspace_layout(args.batch, plan)
    ws = args.workspace
    has_temp = args.temperature != 0
    temp = args.temperature if has_temp else ws + off_m           # never read without a temperature
    aligned = args.logits % 16 == 0 and (args.batch <= 1 or (args.row_stride * itemsize) % 16 == 0)
    chunk_ptrs = (args.logits, args.token_ids, temp, ws + off_m, ws + off_s, ws + off_c)
    chunk_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", "float32", "int32")
    chunk_ints = (args.vocab, args.row_stride, plan.chunk_blocks, plan.n_tiles)
    chunk_const = {"BLOCK": plan.tile, "VEC": 16 // itemsize, "ALIGNED": aligned, "HAS_TEMP": has_temp}
    comb_ptrs = (args.logits, args.token_ids, temp, args.logprobs, args.ranks, args.logprobs, args.ranks,
                 ws + off_m, ws + off_s, ws + off_c, ws + off_m)
    comb_dtypes = (dtypes.logits, dtypes.token_ids, "float32", "float32", dtypes.ranks, "float32", dtypes.ranks,
                   "float32", "float32", "int32", "int64")
    block = min(COMBINE_BLOCK, _next_pow2(max(plan.n_tiles, 2)))
    comb_const = {"BLOCK": block, "LOG_BLOCK": block.bit_length() - 1, "HAS_TEMP": has_temp, "K_PAD": 0,
                  "KEY_TILES": 2, "TREE": False}
    return [
        (logprob_rank_chunk_kernel, (args.batch, plan.n_tiles, 1), chunk_ptrs, chunk_dtypes, chunk_ints,
         chunk_const, plan.num_warps),
        (logprob_rank_combine_kernel, (args.batch, 1, 1), comb_ptrs, comb_dtypes,
         (args.vocab, args.row_stride, plan.n_tiles, 0), comb_const, COMBINE_NUM_WARPS),
    ]


def _compiled_launches(args, dtypes, device_id, plan):
    from ._compiled import compiled
    for kernel, grid, ptrs, ptr_dtypes, ints, constexprs, num_warps in launch_specs(args, dtypes, plan):
        yield compiled(kernel, device_id, ptr_dtypes, len(ints), constexprs, num_warps), grid, ptrs, ints


def launch_logprob_rank(args: LogprobRankArgs, dtypes: LogprobRankDtypes, device_id: int, stream: int,
                        plan: Optional[LogprobRankPlan] = None) -> None:
    """Queue the call's two kernels on ``stream`` (stream-ordered, never blocking; the first
    call per device and signature compiles, host-blocking). The current CUDA context must be
    that of ``device_id``."""
    for kernel, grid, ptrs, ints in _compiled_launches(args, dtypes, device_id, plan):
        kernel.launch(grid, stream, *ptrs, *ints)


def bind_logprob_rank_launch(args: LogprobRankArgs, dtypes: LogprobRankDtypes, device_id: int,
                             plan: Optional[LogprobRankPlan] = None) -> Callable[[int], None]:
    """Return ``launch(stream)`` that queues this exact call (arguments packed once)."""
    launches: List[Callable[[int], None]] = [kernel.bind(grid, *ptrs, *ints) for kernel, grid, ptrs, ints
                                             in _compiled_launches(args, dtypes, device_id, plan)]
    first, second = launches

    def launch(stream: int) -> None:
        first(stream)
        second(stream)

    return launch


# -- device helpers -------------------------------------------------------------------------------

@triton.jit
def _tree_sum(x, LOG_N: tl.constexpr, HIGH_BITS: tl.constexpr, TREE: tl.constexpr):
    """Sum of the ``2**LOG_N`` elements of ``x`` in a fixed binary tree over the index bits:
    the ``HIGH_BITS`` highest bits first (elements one register pass apart), then the others
    from the lowest up. Every node adds two values (a + b == b + a), so the result depends on
    the indices alone, never on which thread holds which element."""
    if TREE:
        h = tl.reshape(x, [2] * LOG_N)
        for i in tl.static_range(HIGH_BITS):
            h = tl.sum(h, axis=0)
        for i in tl.static_range(LOG_N - HIGH_BITS):
            h = tl.sum(h, axis=LOG_N - HIGH_BITS - 1 - i)
        return h
    else:
        return tl.sum(x, axis=0)


@triton.jit
def _scaled(x, t, HAS_TEMP: tl.constexpr):
    if HAS_TEMP:
        return tl.math.div_rn(x, t)      # IEEE division, as logits / T in torch and numpy
    else:
        return x


@triton.jit
def _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP: tl.constexpr):
    """The row's token id, whether it is valid, its scaled logit (NaN when invalid) and T."""
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row)
    else:
        t = 1.0
    chosen = _scaled(tl.load(row_ptr + tl.where(valid, token, 0)).to(tl.float32), t, HAS_TEMP)
    return valid, tl.where(valid, chosen, float("nan")), t


@triton.jit
def _keys(y, cols, ok):
    """64-bit keys ordering (value descending, then column ascending); NaN and masked lanes get
    the smallest key. -0.0 is keyed as +0.0 (they compare equal, so the lower id wins)."""
    y = tl.where(y == 0.0, 0.0, y)
    b = y.to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    low = (~cols).to(tl.uint32, bitcast=True).to(tl.int64)        # 2**32 - 1 - column
    key = (o.to(tl.int64) << 32) | low
    return tl.where(ok & (y == y), key, _KEY_PAD)


@triton.jit
def _merge_top(a, b, K_PAD: tl.constexpr):
    """The best ``K_PAD`` of two sets of ``K_PAD`` keys (order of the inputs is irrelevant)."""
    both = tl.reshape(tl.join(a, b), [2 * K_PAD])
    return tl.topk(both, K_PAD)


@triton.jit
def _keys_at(row_ptr, cols, ok, t, HAS_TEMP: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return _keys(_scaled(x, t, HAS_TEMP), cols, ok)


@triton.jit
def _compact(sel, cols, dst):
    """Write the columns where ``sel`` holds to ``dst[0..)``, in column order."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(dst + pos, cols, mask=sel)


@triton.jit
def _tile_topk(y, cols, valid, row_ptr, t, cand_dst, start, vocab, top_k, TILE: tl.constexpr,
               HAS_TEMP: tl.constexpr, K_PAD: tl.constexpr, N_GROUPS: tl.constexpr, CAP: tl.constexpr):
    """The tile's best ``K_PAD`` keys (exact for its best ``top_k``; see the module docstring)."""
    real = valid & (y == y)
    yk = tl.where(real, y, float("-inf"))
    gmax = tl.max(tl.reshape(yk, [N_GROUPS, TILE // N_GROUPS]), axis=1)
    tau = tl.min(tl.topk(gmax, K_PAD), axis=0)
    # K_PAD groups have a maximum >= tau, so at least K_PAD >= top_k real logits are >= tau
    # (or tau = -inf and every real logit passes): the tile's best top_k all pass.
    ge = real & (yk >= tau)
    n_sel = tl.sum(ge.to(tl.int32), axis=0)
    if n_sel <= CAP:
        _compact(ge, cols, cand_dst)
    else:
        # Many ties at tau (a tile of -inf, say): only the top_k lowest columns equal to tau
        # can be selected.
        gt = real & (yk > tau)
        eq = real & (yk == tau)
        n_eq = tl.sum(eq.to(tl.int32), axis=0)
        n_sel = tl.sum(gt.to(tl.int32), axis=0) + tl.minimum(n_eq, top_k)
        if n_sel <= CAP:
            eq_i = eq.to(tl.int32)
            before = tl.cumsum(eq_i, axis=0) - eq_i
            _compact(gt | (eq & (before < top_k)), cols, cand_dst)
        else:
            n_sel = -1
    tl.debug_barrier()              # the compacted columns are read by other threads below
    j = tl.arange(0, CAP)
    if n_sel >= 0:
        ok = j < n_sel
        c = tl.load(cand_dst + j, mask=ok, other=0)
        best = tl.topk(_keys_at(row_ptr, c, ok, t, HAS_TEMP), K_PAD)
    else:
        best = tl.full([K_PAD], _KEY_PAD, tl.int64)
        for off in range(0, TILE, CAP):
            c = start + off + j
            best = _merge_top(best, tl.topk(_keys_at(row_ptr, c, c < vocab, t, HAS_TEMP), K_PAD), K_PAD)
    return best


@triton.jit
def _online_update(x, m, s):
    """Fold the ``[LINES, VEC]`` block ``x`` into the per-line running max ``m`` and sum ``s``
    (an online log-sum-exp: ``m' = max(m, max(x))``, ``s' = s * exp(m - m') + sum(exp(x - m'))``).
    Each thread owns whole lines of ``VEC`` contiguous logits (one 16-byte vector), so the line
    max and line sum stay inside the thread: no shuffles, no barriers."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    scale = tl.exp2((m - m_new) * _LOG2E)                 # m = m_new = +inf: NaN, as it should
    terms = tl.exp2((x - m_new[:, None]) * _LOG2E)        # x = -inf: 0; x = NaN: NaN
    return m_new, s * scale + tl.sum(terms, axis=1)


# -- kernels ----------------------------------------------------------------------------------------

@triton.jit(
    do_not_specialize=["vocab", "row_stride", "chunk_blocks", "n_chunks"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "temp_ptr", "part_m_ptr", "part_s_ptr",
                                    "part_c_ptr"],
)
def logprob_rank_chunk_kernel(
    logits_ptr,         # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,            # [batch] int32/int64 token per row
    temp_ptr,           # [batch] float32 temperature (read when HAS_TEMP)
    part_m_ptr,         # [batch * n_chunks] float32 out: chunk maximum (-FLT_MAX for a chunk of -inf)
    part_s_ptr,         # [batch * n_chunks] float32 out: sum of exp(y - max)
    part_c_ptr,         # [batch * n_chunks] int32 out: count of y >= y[token]
    vocab,
    row_stride,         # elements between rows
    chunk_blocks,       # blocks of BLOCK logits per chunk
    n_chunks,           # chunks per row (grid axis 1)
    BLOCK: tl.constexpr,    # logits per loop step
    VEC: tl.constexpr,      # logits per 16-byte vector (8 for 2-byte dtypes, 4 for float32)
    ALIGNED: tl.constexpr,  # logits_ptr and row_stride * itemsize are multiples of 16 bytes
    HAS_TEMP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row * row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
    valid_tok, chosen, t = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    start = chunk * (chunk_blocks * BLOCK)
    n_here = tl.minimum(chunk_blocks * BLOCK, vocab - start)
    full_end = start + (n_here // BLOCK) * BLOCK
    end = start + n_here
    LINES: tl.constexpr = BLOCK // VEC
    cols = tl.arange(0, LINES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([LINES], _NEG_FLT_MAX, tl.float32)
    s = tl.zeros([LINES], tl.float32)
    count = tl.zeros([LINES, VEC], tl.int32)
    # Whole blocks: unmasked (16-byte vector loads when ALIGNED).
    for off in tl.range(start, full_end, BLOCK, loop_unroll_factor=2):
        y = _scaled(tl.load(row_ptr + off + cols).to(tl.float32), t, HAS_TEMP)
        count += (y >= chosen).to(tl.int32)
        m, s = _online_update(y, m, s)
    # The partial last block (all masked off when there is none).
    idx = full_end + cols
    inside = idx < end
    y = _scaled(tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32), t, HAS_TEMP)
    count += ((y >= chosen) & inside).to(tl.int32)
    m, s = _online_update(y, m, s)
    big = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2((m - big) * _LOG2E), axis=0)   # a line whose max is +inf: NaN
    part = row * n_chunks + chunk
    tl.store(part_m_ptr + part, big)
    tl.store(part_s_ptr + part, total)
    tl.store(part_c_ptr + part, tl.sum(tl.sum(count, axis=1), axis=0))


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_tiles", "top_k"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "temp_ptr", "part_m_ptr", "part_s_ptr",
                                    "part_c_ptr", "part_k_ptr", "cand_ptr"],
)
def logprob_rank_tile_kernel(
    logits_ptr,         # [batch, row_stride] float32/bfloat16/float16, first `vocab` columns read
    ids_ptr,            # [batch] int32/int64 token per row
    temp_ptr,           # [batch] float32 temperature (read when HAS_TEMP)
    part_m_ptr,         # [batch * n_tiles] float32 out: tile maximum
    part_s_ptr,         # [batch * n_tiles] float32 out: sum of exp(y - max)
    part_c_ptr,         # [batch * n_tiles] int32 out: count of y >= y[token]
    part_k_ptr,         # [batch * n_tiles, K_PAD] int64 out: the tile's best keys (K_PAD > 0)
    cand_ptr,           # [batch * n_tiles, CAP] int32 scratch: candidate columns (K_PAD > 0)
    vocab,
    row_stride,         # elements between rows
    n_tiles,            # programs per row
    top_k,
    TILE: tl.constexpr, LOG_TILE: tl.constexpr, HIGH_BITS: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_TEMP: tl.constexpr, K_PAD: tl.constexpr, N_GROUPS: tl.constexpr, CAP: tl.constexpr, TREE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_tiles
    start = ((pid - row * n_tiles) * TILE).to(tl.int32)
    row_ptr = logits_ptr + row * row_stride
    if ALIGNED:
        row_ptr = tl.multiple_of(row_ptr, 16)
    valid_tok, chosen, t = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    cols = start + tl.arange(0, TILE)
    valid = cols < vocab
    if start + TILE <= vocab:
        # A whole tile: unmasked, so the loads are 16-byte vectors (a mask on a runtime vocab
        # would make every load a scalar one).
        x = tl.load(row_ptr + cols)
    else:
        x = tl.load(row_ptr + cols, mask=valid, other=float("-inf"))
    y = _scaled(x.to(tl.float32), t, HAS_TEMP)
    y = tl.where(valid, y, float("-inf"))
    m = tl.max(y, axis=0)                                   # NaN is skipped here, but poisons the sum
    m_safe = tl.where(m == float("-inf"), 0.0, m)           # a tile of -inf: sum 0, not NaN
    s = _tree_sum(tl.exp2((y - m_safe) * _LOG2E), LOG_TILE, HIGH_BITS, TREE)
    count = tl.sum(((y >= chosen) & valid).to(tl.int32), axis=0)
    tl.store(part_m_ptr + pid, m)
    tl.store(part_s_ptr + pid, s)
    tl.store(part_c_ptr + pid, count)
    if K_PAD > 0:
        best = _tile_topk(y, cols, valid, row_ptr, t, cand_ptr + pid * CAP, start, vocab, top_k, TILE,
                          HAS_TEMP, K_PAD, N_GROUPS, CAP)
        tl.store(part_k_ptr + pid * K_PAD + tl.arange(0, K_PAD), best)


@triton.jit(
    do_not_specialize=["vocab", "row_stride", "n_tiles", "top_k"],
    do_not_specialize_on_alignment=["logits_ptr", "ids_ptr", "temp_ptr", "logprob_ptr", "rank_ptr",
                                    "topk_lp_ptr", "topk_id_ptr", "part_m_ptr", "part_s_ptr", "part_c_ptr",
                                    "part_k_ptr"],
)
def logprob_rank_combine_kernel(
    logits_ptr, ids_ptr, temp_ptr,   # as in the tile kernel (only the token's own logit is read)
    logprob_ptr,        # [batch] float32 out
    rank_ptr,           # [batch] int32/int64 out
    topk_lp_ptr,        # [batch, top_k] float32 out (K_PAD > 0)
    topk_id_ptr,        # [batch, top_k] int32/int64 out (K_PAD > 0)
    part_m_ptr, part_s_ptr, part_c_ptr, part_k_ptr,
    vocab, row_stride, n_tiles, top_k,
    BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr, K_PAD: tl.constexpr,
    KEY_TILES: tl.constexpr, TREE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    valid, chosen, t = _token(row_ptr, ids_ptr, temp_ptr, row, vocab, HAS_TEMP)
    base = row * n_tiles
    j = tl.arange(0, BLOCK)
    big = float("-inf")
    for j0 in range(0, n_tiles, BLOCK):
        big = tl.maximum(big, tl.max(tl.load(part_m_ptr + base + j0 + j, mask=j0 + j < n_tiles,
                                             other=float("-inf")), axis=0))
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = 0.0
    count = 0
    for j0 in range(0, n_tiles, BLOCK):
        inside = j0 + j < n_tiles
        m = tl.load(part_m_ptr + base + j0 + j, mask=inside, other=float("-inf"))
        s = tl.load(part_s_ptr + base + j0 + j, mask=inside, other=0.0)
        total += _tree_sum(s * tl.exp2((m - big_safe) * _LOG2E), LOG_BLOCK, 0, TREE)
        count += tl.sum(tl.load(part_c_ptr + base + j0 + j, mask=inside, other=0), axis=0)
    lse = big + tl.log(total)                   # total == 0 only for a row of -inf: lse = -inf
    tl.store(logprob_ptr + row, tl.where(valid, chosen - lse, float("nan")))
    tl.store(rank_ptr + row, tl.where(valid, count, -1).to(rank_ptr.dtype.element_ty))
    if K_PAD > 0:
        kk = tl.arange(0, K_PAD)
        tt = tl.arange(0, KEY_TILES)
        best = tl.full([K_PAD], _KEY_PAD, tl.int64)
        for t0 in range(0, n_tiles, KEY_TILES):
            ptrs = part_k_ptr + (base + t0 + tt)[:, None] * K_PAD + kk[None, :]
            keys = tl.load(ptrs, mask=(t0 + tt < n_tiles)[:, None], other=_KEY_PAD)
            best = _merge_top(best, tl.topk(tl.reshape(keys, [KEY_TILES * K_PAD]), K_PAD), K_PAD)
        pad = best == _KEY_PAD
        o = (best >> 32).to(tl.int32)
        y = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        col = ~(best.to(tl.int32))                  # the padding key decodes to -1
        out = row * top_k + kk
        keep = kk < top_k
        tl.store(topk_lp_ptr + out, tl.where(pad, float("nan"), y - lse), mask=keep)
        tl.store(topk_id_ptr + out, col.to(topk_id_ptr.dtype.element_ty), mask=keep)
