"""The backward of the logprob op: the gradient of its logprobs (token and top-k) and entropy with
respect to the logits and the temperature, one read of the logits and one write of the gradient.

For row ``b`` with ``y = logits[b] / T``, ``p = softmax(y)``, ``lse = logsumexp(y)``, token ``t``
(with ``argmax``, a negative id is the row's greedy token), top-k ids ``i_k``, upstream gradients
``g`` (logprob), ``g_k`` (top-k logprobs) and ``g_H`` (entropy ``H``):

- ``dL/dy_j = g [j == t] + sum_k g_k [j == i_k] - p_j (g + sum_k g_k) - g_H p_j (log p_j + H)``;
- ``grad_logits[b, j] = dL/dy_j / T`` (stored in the logits' dtype, computed in float32);
- ``grad_temperature[b] = -(1 / T) sum_j dL/dy_j (y_j - lse)`` (``sum_j dL/dy_j = 0``, so the
  shift by ``lse`` changes nothing but the rounding), e.g. ``(E_p[y] - y_t) / T`` for the logprob.

The row's log-normaliser is not reduced again: it is recovered from the forward's outputs,
``lse = y[i_1] - topk_logprobs[b, 0]`` when top-k outputs are given (the top-1 logprob lies in
``[-log vocab, 0]``, so the recovery is exact to ``lse``'s own rounding), else ``lse = y[t] -
logprobs[b]`` (exact to float32 rounding of ``max(|y[t]|, |logprob|)``: ``p`` to a relative
``1e-5`` for logprobs down to -100). Reducing the row again would read the logits twice (1.5x the
floor of one read and one write). Only a row with neither source finite (the token's logit
``-inf``, an id out of range with an entropy or top-k gradient) reduces its row again, in each of
its programs. A row whose logprob is a constant NaN for want of a valid id, and which has no
other gradient, gets zeros. A row without a finite normaliser (a NaN or ``+inf`` logit, only
``-inf``, a temperature not finite and ``> 0``) gets NaN in every column and in its temperature
gradient.

Batch-invariant: a row is cut into ``n_chunks`` chunks of ``chunk_blocks`` blocks of ``block``
logits from the vocabulary alone; a chunk's program sums its part of the temperature gradient in
one order, and the combine kernel adds a row's chunks in chunk order. The gradient of the logits
is elementwise once ``lse`` is known, and ``lse`` is the row's own.

Layout: :func:`plan_logprob_backward` (the variant), :func:`kernel_specs` (its kernels),
:func:`launch_logprob_backward` / :func:`bind_logprob_backward_launch` (integers and a stream).
The ``@triton.jit`` kernels are in :mod:`._logprob_backward_jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

from ._intmath import cdiv, next_pow2
from ._logprob_backward_jit import logprob_backward_combine_kernel, logprob_backward_kernel

__all__ = [
    "LogprobBackwardArgs",
    "LogprobBackwardDtypes",
    "BackwardVariant",
    "plan_logprob_backward",
    "plan_for_backward",
    "backward_workspace_bytes",
    "kernel_specs",
    "call_arguments",
    "launch_logprob_backward",
    "bind_logprob_backward_launch",
]

BLOCK = 2048  # logits per loop step (small vocabularies: the next power of two, at least 128)
WARPS = 4
CHUNKS = 24  # chunks per row, about: 256 rows of 151,936 give 4,864 programs of 8,192 logits
COMBINE_WARPS = 1
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class LogprobBackwardArgs(NamedTuple):
    """The integers of one backward call: byte addresses (0 where absent) and sizes (elements)."""

    logits: int
    token_ids: int
    argmax: int  # [batch] greedy tokens of the forward (negative ids scored as them), or 0
    temperature: int  # [batch] float32, or 0
    logprobs: int  # [batch] float32: the forward's logprobs
    grad_logprobs: int  # [batch] float32, or 0 (no gradient)
    topk_ids: int  # [batch, top_k], or 0
    topk_logprobs: int  # [batch, top_k] float32, or 0
    grad_topk_logprobs: int  # [batch, top_k] float32, or 0
    entropy: int  # [batch] float32: the forward's entropy, or 0
    grad_entropy: int  # [batch] float32, or 0
    grad_logits: int  # [batch, grad_row_stride] out, the logits' dtype
    grad_temperature: int  # [batch] float32 out, or 0
    workspace: int  # batch * n_chunks float32 partials (with grad_temperature), or 0
    batch: int
    vocab: int
    row_stride: int  # elements between the logits' rows
    grad_row_stride: int  # elements between grad_logits' rows
    top_k: int


class LogprobBackwardDtypes(NamedTuple):
    """Element type names: ``logits`` (and ``grad_logits``) float32/bfloat16/float16, the ids
    int32/int64."""

    logits: str
    token_ids: str
    argmax: str = "int32"
    topk_ids: str = "int32"


@dataclasses.dataclass(frozen=True)
class BackwardVariant:
    """How one call runs: the row split (``block``, ``chunk_blocks``, ``n_chunks``: the
    vocabulary's alone), ``num_warps``, the compiled options: ``aligned`` (every row of the logits
    and the gradient starts on 16 bytes: vector loads and stores), ``k_pad`` (0, or the power of
    two >= top_k), and which inputs exist."""

    block: int
    num_warps: int
    chunk_blocks: int
    n_chunks: int
    aligned: bool = True
    k_pad: int = 0
    temperature: bool = False
    argmax: bool = False
    grad_logprobs: bool = True
    grad_topk: bool = False
    entropy: bool = False
    grad_temperature: bool = False


@lru_cache(maxsize=4096)
def plan_logprob_backward(
    vocab: int,
    *,
    aligned: bool = True,
    top_k: int = 0,
    temperature: bool = False,
    argmax: bool = False,
    grad_logprobs: bool = True,
    grad_topk: bool = False,
    entropy: bool = False,
    grad_temperature: bool = False,
    block: int | None = None,
    chunk_blocks: int | None = None,
    num_warps: int | None = None,
) -> BackwardVariant:
    """The variant of a backward over rows of ``vocab`` logits (host-only, pure, cached; never a
    function of the batch). ``block``, ``chunk_blocks``, ``num_warps`` override the plan (tuning,
    tests; any fixed choice is batch-invariant)."""
    block = block or min(BLOCK, max(128, next_pow2(vocab)))
    num_warps = num_warps or max(1, min(WARPS, block // 512))
    n_blocks = cdiv(vocab, block)
    chunk_blocks = chunk_blocks or cdiv(n_blocks, CHUNKS)
    k_pad = 0 if top_k <= 0 else next_pow2(top_k)
    return BackwardVariant(
        block=block,
        num_warps=num_warps,
        chunk_blocks=chunk_blocks,
        n_chunks=cdiv(n_blocks, chunk_blocks),
        aligned=aligned,
        k_pad=k_pad,
        temperature=temperature,
        argmax=argmax,
        grad_logprobs=grad_logprobs,
        grad_topk=grad_topk and k_pad > 0,
        entropy=entropy,
        grad_temperature=grad_temperature and temperature,
    )


def plan_for_backward(args: LogprobBackwardArgs, dtypes: LogprobBackwardDtypes, **options: Any) -> BackwardVariant:
    """:func:`plan_logprob_backward` for the call ``args`` (its layout and its inputs)."""
    size = _ITEMSIZE[dtypes.logits]
    strides = (args.row_stride, args.grad_row_stride) if args.batch > 1 else ()
    aligned = args.logits % 16 == 0 and args.grad_logits % 16 == 0 and all(s * size % 16 == 0 for s in strides)
    return plan_logprob_backward(
        args.vocab,
        aligned=aligned,
        top_k=args.top_k if args.topk_ids else 0,
        temperature=args.temperature != 0,
        argmax=args.argmax != 0,
        grad_logprobs=args.grad_logprobs != 0,
        grad_topk=args.grad_topk_logprobs != 0,
        entropy=args.grad_entropy != 0,
        grad_temperature=args.grad_temperature != 0,
        **options,
    )


def backward_workspace_bytes(batch: int, vocab: int, grad_temperature: bool) -> int:
    """Bytes of device workspace a backward needs: ``4 * n_chunks`` per row with a temperature
    gradient (the chunks' partial sums; 24 chunks at vocab 151,936: 96 bytes per row), else 0.
    Host-only, pure."""
    if batch <= 0 or not grad_temperature:
        return 0
    return 4 * batch * plan_logprob_backward(vocab).n_chunks


class KernelSpec(NamedTuple):
    """One kernel of a variant, as :func:`._compiled.compiled` takes it."""

    kernel: Any
    pointer_dtypes: tuple[str | None, ...]  # None: a pointer the variant lacks (a constexpr None)
    n_ints: int
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int


@lru_cache(maxsize=1024)
def kernel_specs(variant: BackwardVariant, dtypes: LogprobBackwardDtypes) -> tuple[KernelSpec, ...]:
    """The kernels of ``variant`` (host-only, pure, cached): the chunk kernel, then with a
    temperature gradient the combine kernel."""
    v, f32 = variant, "float32"

    def opt(flag: bool, dtype: str) -> str | None:
        return dtype if flag else None

    ptrs = (
        dtypes.logits,
        dtypes.token_ids,
        opt(v.argmax, dtypes.argmax),
        opt(v.temperature, f32),
        f32,
        opt(v.grad_logprobs, f32),
        opt(v.k_pad > 0, dtypes.topk_ids),
        opt(v.k_pad > 0, f32),
        opt(v.grad_topk, f32),
        opt(v.entropy, f32),
        opt(v.entropy, f32),
        dtypes.logits,
        opt(v.grad_temperature, f32),
    )
    const = dict(BLOCK=v.block, ALIGNED=v.aligned, K_PAD=max(v.k_pad, 1), TOPK=v.k_pad > 0)
    const.update(NP=next_pow2(v.k_pad + 1) if v.k_pad else 2, HAS_TEMP=v.temperature, ARGMAX=v.argmax)
    const.update(HAS_GLP=v.grad_logprobs, GTOPK=v.grad_topk, ENTROPY=v.entropy, TEMP_GRAD=v.grad_temperature)
    main = KernelSpec(logprob_backward_kernel, ptrs, 5, tuple(const.items()), v.num_warps)
    if not v.grad_temperature:
        return (main,)
    comb = KernelSpec(
        logprob_backward_combine_kernel,
        (f32, f32, f32),
        1,
        (("BLOCK", next_pow2(max(v.n_chunks, 2))),),
        COMBINE_WARPS,
    )
    return main, comb


def call_arguments(args: LogprobBackwardArgs, variant: BackwardVariant) -> tuple[tuple, ...]:
    """``(grid, pointers, ints)`` per kernel of :func:`kernel_specs` for the call ``args``."""
    v = variant

    def opt(flag: bool, ptr: int) -> int | None:
        return ptr if flag else None

    ptrs = (
        args.logits,
        args.token_ids,
        opt(v.argmax, args.argmax),
        opt(v.temperature, args.temperature),
        args.logprobs,
        opt(v.grad_logprobs, args.grad_logprobs),
        opt(v.k_pad > 0, args.topk_ids),
        opt(v.k_pad > 0, args.topk_logprobs),
        opt(v.grad_topk, args.grad_topk_logprobs),
        opt(v.entropy, args.entropy),
        opt(v.entropy, args.grad_entropy),
        args.grad_logits,
        opt(v.grad_temperature, args.workspace),
    )
    ints = (args.vocab, args.row_stride, args.grad_row_stride, v.chunk_blocks, args.top_k)
    main = ((args.batch, v.n_chunks, 1), ptrs, ints)
    if not v.grad_temperature:
        return (main,)
    comb = ((args.batch, 1, 1), (args.workspace, args.temperature, args.grad_temperature), (v.n_chunks,))
    return main, comb


def _compiled_launches(args, dtypes, device_id, variant):
    from ._compiled import compiled

    if variant is None:
        variant = plan_for_backward(args, dtypes)
    specs = kernel_specs(variant, dtypes)
    kernels = [
        compiled(s.kernel, device_id, s.pointer_dtypes, s.n_ints, dict(s.constexprs), s.num_warps) for s in specs
    ]
    return [(kernel, *call) for kernel, call in zip(kernels, call_arguments(args, variant))]


def launch_logprob_backward(
    args: LogprobBackwardArgs,
    dtypes: LogprobBackwardDtypes,
    device_id: int,
    stream: int,
    variant: BackwardVariant | None = None,
) -> None:
    """Queue the backward's kernels on ``stream`` (stream-ordered, never blocking; the first call
    per device and signature compiles, host-blocking). The current CUDA context must be that of
    ``device_id``; ``args.batch >= 1``. ``variant`` overrides the plan (tuning)."""
    for kernel, grid, ptrs, ints in _compiled_launches(args, dtypes, device_id, variant):
        kernel.launch(grid, stream, *ptrs, *ints)


def bind_logprob_backward_launch(
    args: LogprobBackwardArgs,
    dtypes: LogprobBackwardDtypes,
    device_id: int,
    variant: BackwardVariant | None = None,
) -> Callable[[int], None]:
    """Return ``launch(stream)`` that queues this exact call (arguments packed once, one
    ``cuLaunchKernel`` per kernel). ``variant`` overrides the plan (tuning)."""
    bound = [
        kernel.bind(grid, *ptrs, *ints)
        for kernel, grid, ptrs, ints in _compiled_launches(args, dtypes, device_id, variant)
    ]

    def launch(stream: int) -> None:
        for b in bound:
            b(stream)

    return launch
