"""Logprob, rank and top-k of one token per row: one read of the logits, the same bits at any batch size.

For row ``b`` with token ``t = token_ids[b]``, ``T = temperature[b]`` (1 without one) and ``y =
logits[b, :vocab] / T`` in float32: ``logprob[b] = y[t] - log(sum(exp(y)))``; ``rank[b] =
count(y >= y[t])`` (vLLM's; NaN never counts); optionally the ``top_k`` largest ``y`` (sorted,
ties to the lower id, NaN never selected), the greedy token (the lowest id of the largest
non-NaN ``y``; a row with a negative id is then scored as it) and the entropy
``-sum(p * log(p))`` of ``p = softmax(y)`` (float32, natural log).

This module is the op's host side: :func:`plan_logprob_rank` returns a call's
:class:`LogprobVariant` (cached per batch, vocabulary, dtype, top-k and options),
:func:`kernel_specs` its kernels, :func:`launch_logprob_rank` and :func:`bind_logprob_rank_launch`
queue them on a stream with integers only. The ``@triton.jit`` kernels: :mod:`._logprob_rank_jit`
(with the row's merge and top-k; a chunk's partial and the online reductions, the entropy's among
them: :mod:`._logprob_chunk_jit`).

Design reasons:

- Batch invariance: a row is cut into ``n_chunks`` chunks of ``chunk_blocks`` blocks of
  ``block`` logits from the vocabulary alone (151,936: 13 chunks of 6 blocks of 2,048); a
  chunk's partial comes from the same instructions whichever program runs it, and a row's
  partials merge in chunk order. Only where chunks run follows the batch: ``group`` chunks per
  program (large programs at large batches pay a program's start and the token's dependent
  loads once) and the cluster form.
- Blocks read as 16-byte lines, a line per thread with its own running max and sum (no shuffles
  or barriers per block); about 13 chunks per row measured best from batch 1 to 4,096.
  Rows not 16-byte aligned (GPT-2's 50,257, a padded stride) read each line as the two aligned
  vectors around it, shifted into place: the registers and bits of aligned rows, at a higher
  cost per chunk, so their chunks are at least 4 blocks long.
- bfloat16 without a temperature takes the fused ``words`` path: words of two logits, one fused
  multiply-add per exponent, a packed ``bf16x2`` compare per word for the rank (229 instead of
  342 instructions per 32 logits); a chunk whose maximum lies beyond ``+-2**20`` is flagged and
  re-summed exactly by the combine kernel.
- Top-k from the same read: per-line maxima, then a read-back of the vectors that can pass a
  threshold (:mod:`._logprob_rank_jit`); its chunk kernel: at most 64 registers, 2 chunks each.
- sm_90+: without top-k, when a call's rows fit on the device at once, a row's programs form one
  cluster whose first program merges the row (one kernel instead of two: faster up to about 64
  rows of 151,936; beyond, two kernels); either way the same bits. Bound calls are programmatic
  dependent launches of the kernel before them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

from ._intmath import cdiv, next_pow2
from ._logprob_rank_jit import logprob_rank_chunk_kernel, logprob_rank_combine_kernel

__all__ = [
    "LogprobVariant",
    "LogprobRankArgs",
    "LogprobRankDtypes",
    "KernelSpec",
    "plan_logprob_rank",
    "plan_for_call",
    "workspace_layout",
    "kernel_specs",
    "launch_logprob_rank",
    "bind_logprob_rank_launch",
]

BLOCK = 2048  # logits per block (the largest; small vocabularies take the next power of two)
CHUNK_WARPS = 4
CHUNKS = 13  # chunks per row, about
ALIGN_LOGITS = 8  # a vocabulary not a multiple of 8 leaves contiguous 2-byte rows unaligned
UNALIGNED_CHUNK_BLOCKS = 4
GROUPS, MIN_PROGRAMS = (4, 2, 1), 2048  # chunks per program: the largest leaving >= MIN_PROGRAMS
TOPK_GROUPS, TOPK_MIN_PROGRAMS = (2, 1), 1024
TOPK_SEL = 128  # group maxima for the top-k threshold
TOPK_MAXNREG = 64
MAX_CHUNKS = 256  # the combine kernel holds a row's partials in one tile
COMBINE_KEYS = 1024  # top-k keys per merge step of the combine kernel
COMBINE_WARPS, COMBINE_TOPK_WARPS = 1, 4
CLUSTER_MAX = 16  # a row's programs per cluster (above 8: a non-portable size)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    argmax: int = 0  # [batch] int32/int64 greedy tokens out, or 0
    entropy: int = 0  # [batch] float32 entropies out, or 0


class LogprobRankDtypes(NamedTuple):
    """Element type names: ``logits`` float32/bfloat16/float16, the rest int32/int64."""

    logits: str
    token_ids: str
    ranks: str
    topk_ids: str = "int32"
    argmax: str = "int32"


@dataclasses.dataclass(frozen=True)
class LogprobVariant:
    """How one call runs: the row split (``block``, ``chunk_blocks``, ``n_chunks``: the
    vocabulary's alone, what makes results batch-invariant), where chunks run (``group`` chunks
    per program of ``num_warps`` warps, ``cluster``), and the compiled form: ``k_pad`` (0, or
    8/32/64 >= top_k) with ``sel`` group maxima, ``maxnreg`` (the chunk kernel's register cap, 0:
    none), ``itemsize`` (bytes per logit), ``words`` (the fused bfloat16 path), ``shift`` (rows
    not 16-byte aligned), ``temperature``, ``argmax``, ``unroll`` (the element path's block loop),
    ``gdc`` (sm_90+: programmatic dependent launches), ``packed_count`` (inline PTX compares),
    ``entropy`` (each chunk's ``u`` and the row's entropy)."""

    block: int
    num_warps: int
    chunk_blocks: int
    n_chunks: int
    group: int = 1
    k_pad: int = 0
    sel: int = 1
    maxnreg: int = 0
    itemsize: int = 2
    words: bool = False
    shift: bool = False
    temperature: bool = False
    argmax: bool = False
    unroll: int = 2
    gdc: bool = False
    cluster: bool = False
    packed_count: bool = False
    entropy: bool = False


class KernelSpec(NamedTuple):
    """One kernel of a variant, as :func:`._compiled.compiled` takes it."""

    kernel: Any
    pointer_dtypes: tuple[str | None, ...]  # None: a pointer the variant lacks (a constexpr None)
    n_ints: int
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    maxnreg: int | None


@lru_cache(maxsize=4096)
def plan_logprob_rank(
    batch: int,
    vocab: int,
    dtype: str = "bfloat16",
    top_k: int = 0,
    *,
    aligned: bool = True,
    temperature: bool = False,
    argmax: bool = False,
    entropy: bool = False,
    sm90: bool = False,
    cluster: bool = True,
    inline_ptx: bool = True,
    block: int | None = None,
    num_warps: int | None = None,
    chunk_blocks: int | None = None,
    group: int | None = None,
    maxnreg: int | None = None,
) -> LogprobVariant:
    """The variant of a call of ``batch`` rows of ``vocab`` logits of ``dtype`` (host-only, pure,
    cached). ``aligned``: rows start on 16 bytes (:func:`plan_for_call` reads it from a call's
    layout); ``sm90``: the device is sm_90 or later (programmatic dependent launches, and with
    ``cluster`` a row's programs may form one cluster); ``inline_ptx`` False for Triton's
    interpreter, which cannot run it. ``block``, ``num_warps``, ``chunk_blocks``, ``group`` and
    ``maxnreg`` override the plan's choice (tuning; any fixed choice is batch-invariant). A split
    into more than :data:`MAX_CHUNKS` chunks is refused (ValueError)."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)} (got {dtype!r})")
    itemsize = _ITEMSIZE[dtype]
    block = block or min(BLOCK, max(128, next_pow2(vocab)))
    num_warps = num_warps or max(1, min(CHUNK_WARPS, block // 512))
    n_blocks = cdiv(vocab, block)
    if chunk_blocks is None:
        chunk_blocks = cdiv(n_blocks, CHUNKS)
        if vocab % ALIGN_LOGITS:
            chunk_blocks = max(chunk_blocks, UNALIGNED_CHUNK_BLOCKS)
    elif cdiv(n_blocks, chunk_blocks) > MAX_CHUNKS:
        raise ValueError(
            f"chunk_blocks={chunk_blocks} cuts rows of {vocab} logits into more than {MAX_CHUNKS} "
            f"chunks of {block}-logit blocks; use chunk_blocks >= {cdiv(n_blocks, MAX_CHUNKS)}"
        )
    n_chunks = cdiv(n_blocks, chunk_blocks)
    k_pad = 0 if top_k <= 0 else (8 if top_k <= 8 else (32 if top_k <= 32 else 64))
    if group is None:
        groups, least = (TOPK_GROUPS, TOPK_MIN_PROGRAMS) if k_pad else (GROUPS, MIN_PROGRAMS)
        group = next((g for g in groups if batch * cdiv(n_chunks, g) >= least), groups[-1])
    words = dtype == "bfloat16" and not temperature
    return LogprobVariant(
        block=block,
        num_warps=num_warps,
        chunk_blocks=chunk_blocks,
        n_chunks=n_chunks,
        group=group,
        k_pad=k_pad,
        sel=min(TOPK_SEL, block // (16 // itemsize)) if k_pad else 1,
        maxnreg=(TOPK_MAXNREG if k_pad else 0) if maxnreg is None else maxnreg,
        itemsize=itemsize,
        words=words,
        shift=not aligned,
        temperature=temperature,
        argmax=argmax,
        # float32 shifted rows hold two vectors per line: unrolled twice, the capped top-k kernel spilled
        unroll=1 if itemsize == 4 and not aligned and k_pad and not argmax and not temperature else 2,
        gdc=sm90,
        cluster=cluster and sm90 and not k_pad and n_chunks <= CLUSTER_MAX,
        packed_count=inline_ptx and words and 4 * chunk_blocks < 1 << 16,
        entropy=entropy,
    )


def _layout_stride(args: LogprobRankArgs) -> int:
    """The row stride (elements) that decides whether rows are 16-byte aligned: the call's own
    for several rows; for one row, the larger stride its layout reports, else that of contiguous
    rows of the vocabulary. A row alone thus takes the kernels of the same rows in a contiguous
    batch (and so the same bits)."""
    return args.row_stride if args.batch > 1 or args.row_stride >= args.vocab else args.vocab


def plan_for_call(args: LogprobRankArgs, dtypes: LogprobRankDtypes, **options: Any) -> LogprobVariant:
    """:func:`plan_logprob_rank` for the call ``args`` (its layout, temperature, argmax and entropy
    outputs)."""
    itemsize = _ITEMSIZE[dtypes.logits]
    aligned = args.logits % 16 == 0 and (_layout_stride(args) * itemsize) % 16 == 0
    return plan_logprob_rank(
        args.batch,
        args.vocab,
        dtypes.logits,
        args.top_k,
        aligned=aligned,
        temperature=args.temperature != 0,
        argmax=args.argmax != 0,
        entropy=args.entropy != 0,
        **options,
    )


def workspace_layout(batch: int, variant: LogprobVariant) -> tuple[int, ...]:
    """Byte offsets of the workspace regions (max, sum, count, top-k keys, candidate keys,
    candidate vectors, the token's logit, its validity, the greedy maximum and its column, the
    entropy's ``u``) and the total size: ``batch * n_chunks`` partials and one token per row, each
    region starting on 16 bytes (the top-k regions are empty without top-k; the others are there
    whatever the variant, so one size serves every call of a shape)."""
    parts, k = batch * variant.n_chunks, variant.k_pad
    offsets, at = [], 0
    sizes = (4 * parts, 4 * parts, 4 * parts, 8 * parts * k, 16 * parts * k, 16 * parts * k)
    for nbytes in sizes + (4 * batch, 4 * batch, 4 * parts, 4 * parts, 4 * parts):
        offsets.append(at)
        at += cdiv(nbytes, 16) * 16
    return (*offsets, at)


@lru_cache(maxsize=1024)
def kernel_specs(variant: LogprobVariant, dtypes: LogprobRankDtypes) -> tuple[KernelSpec, ...]:
    """The kernels of ``variant`` (host-only, pure, cached): the chunk kernel, then the combine
    kernel unless ``variant.cluster`` (a row merged in its cluster's first program)."""
    v, k = variant, variant.k_pad
    vec = 16 // v.itemsize
    argmax_dtype = dtypes.argmax if v.argmax else dtypes.ranks  # never written without argmax
    merge_block = next_pow2(max(v.n_chunks, 2))
    chunk_dtypes: tuple[str | None, ...] = (dtypes.logits, dtypes.token_ids, "float32", "float32", "float32", "int32")
    chunk_dtypes += ("float32", "int32", "int64", "int64", "int32", "float32", "int32", "float32", dtypes.ranks)
    chunk_dtypes += (argmax_dtype,) + (("float32", "float32") if v.entropy else (None, None))
    chunk_const = dict(BLOCK=v.block, VEC=vec, HAS_TEMP=v.temperature, WORDS=v.words, SHIFT=v.shift)
    chunk_const.update(PACKED_COUNT=v.packed_count, GDC=v.gdc, TOPK=k, SEL=v.sel)
    chunk_const.update(ARGMAX=v.argmax, UNROLL=v.unroll, CLUSTER=v.cluster, MERGE_BLOCK=merge_block)
    chunk_const.update(RESUM_BLOCK=32 * COMBINE_WARPS * vec, ENTROPY=v.entropy)
    chunk = KernelSpec(
        logprob_rank_chunk_kernel, chunk_dtypes, 6, tuple(chunk_const.items()), v.num_warps, v.maxnreg or None
    )
    if v.cluster:
        return (chunk,)
    out_dtypes = ("float32", dtypes.topk_ids) if k else ("float32", dtypes.ranks)
    comb_dtypes: tuple[str | None, ...] = (dtypes.logits, "float32", dtypes.ranks) + out_dtypes
    comb_dtypes += ("float32", "float32", "int32", "int64", "float32", "int32", argmax_dtype, "float32", "int32")
    comb_dtypes += ("float32", "float32") if v.entropy else (None, None)
    comb_warps = COMBINE_TOPK_WARPS if k else COMBINE_WARPS
    # the key sets of a row's programs at the largest top-k group, in one merge step
    key_tiles = min(next_pow2(max(cdiv(v.n_chunks, max(TOPK_GROUPS)), 2)), max(2, COMBINE_KEYS // max(k, 1)))
    comb_const = dict(BLOCK=merge_block, K_PAD=k, KEY_TILES=key_tiles, RESUM=v.words)
    comb_const.update(RESUM_BLOCK=32 * comb_warps * vec, VEC=vec, GDC=v.gdc, ARGMAX=v.argmax, ENTROPY=v.entropy)
    return chunk, KernelSpec(logprob_rank_combine_kernel, comb_dtypes, 6, tuple(comb_const.items()), comb_warps, None)


def call_arguments(args: LogprobRankArgs, variant: LogprobVariant) -> tuple[tuple, ...]:
    """``(grid, pointers, ints)`` per kernel of :func:`kernel_specs` for the call ``args``."""
    v = variant
    off_m, off_s, off_c, off_k, off_cand, off_pairs, off_ty, off_tok, off_am, off_a, off_u, _ = workspace_layout(
        args.batch, v
    )
    ws = args.workspace
    m, s, c = ws + off_m, ws + off_s, ws + off_c
    temp = args.temperature or m  # never read without a temperature
    tok = (ws + off_ty, ws + off_tok)
    part_k = ws + off_k if v.k_pad else m  # never read without top-k
    topk_ws = (ws + off_cand, ws + off_pairs) if v.k_pad else (m, m)
    greedy = (ws + off_am, ws + off_a)  # written and read only with argmax
    argmax_out = args.argmax or args.ranks  # never written without argmax
    ent = (ws + off_u, args.entropy) if v.entropy else (None, None)  # constexpr None without entropy
    chunk_ptrs: tuple[int | None, ...] = (args.logits, args.token_ids, temp, m, s, c, *tok, part_k, *topk_ws, *greedy)
    chunk_ptrs += (args.logprobs, args.ranks, argmax_out, *ent)
    chunk_ints = (args.vocab, args.row_stride, v.chunk_blocks, v.n_chunks, v.group, args.top_k)
    chunk = ((args.batch, cdiv(v.n_chunks, v.group), 1), chunk_ptrs, chunk_ints)
    if v.cluster:
        return (chunk,)
    out = (args.topk_logprobs, args.topk_ids) if v.k_pad else (args.logprobs, args.ranks)  # never written without
    comb_ptrs = (args.logits, args.logprobs, args.ranks, *out, m, s, c, part_k, *tok, argmax_out, *greedy, *ent)
    comb_ints = (args.vocab, args.row_stride, v.n_chunks, args.top_k, v.chunk_blocks * v.block, v.group)
    return chunk, ((args.batch, 1, 1), comb_ptrs, comb_ints)


def _compiled_launches(args, dtypes, device_id, variant):
    """``(variant, [(compiled kernel, grid, pointers, ints)])`` of a call; a cluster variant
    whose rows' clusters do not all fit on the device at once runs as two kernels instead."""
    from .._cuda import compute_capability
    from ._compiled import compiled

    if variant is None:
        variant = plan_for_call(args, dtypes, sm90=compute_capability(device_id) >= (9, 0))

    def build(v):
        specs = kernel_specs(v, dtypes)
        kernels = [
            compiled(s.kernel, device_id, s.pointer_dtypes, s.n_ints, dict(s.constexprs), s.num_warps, s.maxnreg)
            for s in specs
        ]
        return [(kernel, *call) for kernel, call in zip(kernels, call_arguments(args, v))]

    launches = build(variant)
    if variant.cluster:
        kernel, grid = launches[0][:2]
        if grid[0] > kernel.max_active_clusters(grid, (1, grid[1], 1)):
            variant = dataclasses.replace(variant, cluster=False)
            launches = build(variant)
    return variant, launches


def launch_logprob_rank(
    args: LogprobRankArgs,
    dtypes: LogprobRankDtypes,
    device_id: int,
    stream: int,
    variant: LogprobVariant | None = None,
) -> None:
    """Queue the call's kernels on ``stream`` (stream-ordered, never blocking; the first call per
    device and signature compiles, host-blocking). The current CUDA context must be that of
    ``device_id``. ``variant`` overrides the plan (tuning)."""
    variant, launches = _compiled_launches(args, dtypes, device_id, variant)
    for kernel, grid, ptrs, ints in launches:
        if variant.cluster:
            kernel.bind(grid, *ptrs, *ints, cluster=(1, grid[1], 1))(stream)
        else:
            kernel.launch(grid, stream, *ptrs, *ints)


def bind_logprob_rank_launch(
    args: LogprobRankArgs,
    dtypes: LogprobRankDtypes,
    device_id: int,
    variant: LogprobVariant | None = None,
) -> Callable[[int], None]:
    """Return ``launch(stream)`` that queues this exact call (arguments packed once; on sm_90+
    each kernel a programmatic dependent launch of the kernel before it). ``variant`` overrides
    the plan (tuning)."""
    variant, launches = _compiled_launches(args, dtypes, device_id, variant)
    bound: list[Callable[[int], None]] = [
        kernel.bind(grid, *ptrs, *ints, cluster=(1, grid[1], 1) if variant.cluster else None, pdl=variant.gdc)
        for kernel, grid, ptrs, ints in launches
    ]
    if len(bound) == 1:
        return bound[0]
    first, second = bound

    def launch(stream: int) -> None:
        first(stream)
        second(stream)

    return launch
