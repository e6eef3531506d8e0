"""Every check of a ``token_logprob_rank`` call and of its backward, on the host, before anything
is launched: the arrays' views, dtypes, shapes, devices and overlaps, the temperature, the
top-k outputs and the workspace size. A rejected call raises here and changes nothing."""

from __future__ import annotations

import numbers
from typing import Any

from ._dlpack import CPU, ArrayView, as_view
from ._dtypes import LOGITS_DTYPES, RANK_DTYPES, TOKEN_DTYPES
from ._numpy_backend import logprob_backward_numpy
from ._streams import stream_handle
from ._validate import INT32_MAX, check_int, check_not_copied, check_view

# -- the arrays of both calls (host-only: they read views and never write) ----------------------
LOGPROB_MAX_VOCAB = 2**30
LOGPROB_TOPK_MAX = 64


def _span(v: ArrayView):
    """Byte range [lo, hi) touched by a view with non-negative strides."""
    if v.size == 0:
        return (v.ptr, v.ptr)
    last = sum((n - 1) * s for n, s in zip(v.shape, v.strides))
    return (v.ptr, v.ptr + (last + 1) * v.itemsize)


def check_disjoint(outputs, inputs=()) -> None:
    """Refuse outputs that overlap each other or the inputs (both ``(name, view)`` pairs, a
    ``None`` view skipped). Inputs may overlap each other: reading memory twice is harmless."""
    outs = [(name, _span(v)) for name, v in outputs if v is not None and v.size]
    ins = [(name, _span(v)) for name, v in inputs if v is not None and v.size]
    for i, (a, (alo, ahi)) in enumerate(outs):
        for b, (blo, bhi) in outs[i + 1 :] + ins:
            if alo < bhi and blo < ahi:
                raise ValueError(
                    f"{a} and {b} overlap in memory ({a} at 0x{alo:x}..0x{ahi:x}, {b} at "
                    f"0x{blo:x}..0x{bhi:x}); the outputs must not alias the inputs or each other"
                )


def check_logits(v: ArrayView) -> ArrayView:
    check_view(v, name="logits", dtypes=LOGITS_DTYPES, ndim=2, contiguous=False)
    batch, vocab = v.shape
    if not 1 <= vocab <= LOGPROB_MAX_VOCAB:
        raise ValueError(
            f"logits must have between 1 and {LOGPROB_MAX_VOCAB} columns (the vocabulary) (got shape {list(v.shape)})"
        )
    row_stride, col_stride = v.strides
    if batch and vocab > 1 and col_stride != 1:
        raise ValueError(
            f"logits must be contiguous along the vocabulary (element stride 1 in dimension 1; "
            f"got shape {list(v.shape)} with element strides {list(v.strides)})"
        )
    if batch > 1 and not 0 <= row_stride <= INT32_MAX:
        raise ValueError(
            f"logits must have a row stride between 0 and {INT32_MAX} elements "
            f"(got shape {list(v.shape)} with element strides {list(v.strides)})"
        )
    return v


def check_token_ids(v: ArrayView, batch: int, device: str) -> ArrayView:
    if not (v.ndim == 1 or (v.ndim == 2 and v.shape[1] == 1)):
        raise ValueError(f"token_ids must be 1-D [batch] or [batch, 1], one token per row (got shape {list(v.shape)})")
    return check_view(v, name="token_ids", dtypes=TOKEN_DTYPES, device=device, length=batch)


def check_workspace_shape(batch: Any, vocab: Any) -> tuple[int, int]:
    """``(batch, vocab)`` of a workspace-size question, checked: ``batch >= 0``, ``1 <= vocab <=
    LOGPROB_MAX_VOCAB``."""
    batch = check_int(batch, name="batch", minimum=0, maximum=INT32_MAX)
    return batch, check_int(vocab, name="vocab", minimum=1, maximum=LOGPROB_MAX_VOCAB)


def check_top_k(top_k: Any, vocab: int) -> int:
    """``top_k`` as an int, checked for a call on ``vocab`` logits: an integer (not a bool)
    between 0 and ``min(TOPK_MAX, vocab)``; ``TypeError``/``ValueError`` naming it and the value
    otherwise. Host-only; the adapters call it before choosing what to run."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int (got {type(top_k).__name__} {top_k!r})")
    limit = min(LOGPROB_TOPK_MAX, vocab)
    if not 0 <= int(top_k) <= limit:
        raise ValueError(
            f"top_k must be between 0 and {limit} (at most {LOGPROB_TOPK_MAX} and at most the "
            f"vocabulary, {vocab}) (got {top_k})"
        )
    return int(top_k)


def check_topk_outputs(lp: ArrayView | None, ids: ArrayView | None, batch: int, top_k: int, device: str) -> None:
    if top_k == 0:
        for name, v in (("out_topk_logprobs", lp), ("out_topk_ids", ids)):
            if v is not None:
                raise ValueError(f"{name} is given but top_k is 0 (pass top_k > 0, or leave {name} out)")
        return
    for name, v, dtypes in (("out_topk_logprobs", lp, ("float32",)), ("out_topk_ids", ids, RANK_DTYPES)):
        if v is None:
            raise ValueError(f"{name} must be given when top_k > 0 (a [batch, top_k] = [{batch}, {top_k}] array)")
        check_view(v, name=name, dtypes=dtypes, device=device, ndim=2, writable=True)
        if tuple(v.shape) != (batch, top_k):
            raise ValueError(f"{name} must have shape [{batch}, {top_k}] ([batch, top_k]) (got shape {list(v.shape)})")


def check_temperature(v: ArrayView, batch: int, device: str) -> ArrayView:
    return check_view(v, name="temperature", dtypes=("float32",), device=device, ndim=1, length=batch)


def check_workspace(v: ArrayView, device: str, need: int) -> ArrayView:
    # Any element type: only the bytes count.
    check_view(v, name="workspace", dtypes=(v.dtype,), device=device, ndim=1, writable=True)
    nbytes = v.size * v.itemsize
    if nbytes < need:
        raise ValueError(
            f"workspace must hold at least {need} bytes for this call (see "
            f"logprob_rank_workspace_bytes; got {nbytes} bytes, {v.describe()})"
        )
    if v.ptr % 16:
        raise ValueError(f"workspace must be aligned to 16 bytes (got address 0x{v.ptr:x})")
    return v


# -- the forward call ---------------------------------------------------------------------------
def logprob_rank_workspace_bytes(batch: int, vocab: int, top_k: int = 0) -> int:
    """Bytes of device workspace a ``[batch, vocab]`` call needs (host-only, pure; the same for
    every logits dtype, with or without ``out_argmax`` and ``out_entropy``): 24 bytes per chunk
    of each row (13 chunks at vocab 151,936) and 8 per row, plus ``32 * k_pad`` per chunk with
    ``top_k`` (``k_pad`` = 8, 32 or 64, the power of two used for ``top_k``), each region rounded
    up to 16 bytes. At vocab 151,936: about 320 bytes per row, 16.6 KiB per row with
    ``top_k = 20``. 0 for an empty batch. Errors (``TypeError``/``ValueError``) name the
    argument: ``batch >= 0``, ``1 <= vocab <= MAX_VOCAB``, ``0 <= top_k <= min(TOPK_MAX, vocab)``."""
    batch, vocab = check_workspace_shape(batch, vocab)
    return _workspace_bytes(batch, vocab, check_top_k(top_k, vocab))


def _workspace_bytes(batch: int, vocab: int, top_k: int) -> int:
    """:func:`logprob_rank_workspace_bytes` of sizes known to be valid (a checked call's)."""
    from .kernels.logprob_rank import plan_logprob_rank, workspace_layout

    if batch == 0:
        return 0
    return workspace_layout(batch, plan_logprob_rank(batch, vocab, "bfloat16", top_k))[-1]


def validated_logprob_call(
    logits,
    token_ids,
    out_logprobs,
    out_ranks,
    stream,
    workspace,
    temperature,
    top_k,
    out_topk_logprobs,
    out_topk_ids,
    out_argmax,
    out_entropy,
    bound=False,
):
    """Every check of a call: ``None`` when there is nothing to compute (empty batch), else
    ``(numpy backend arguments, kernel args or None, kernel dtypes or None, stream)``; the
    kernel args are None on the CPU backend. ``bound``: the call is bound, its inputs may not be
    copies (the outputs never may)."""
    handle = stream_handle(stream)
    lv = check_logits(as_view(logits, name="logits", stream=handle))
    device = lv.device
    batch, vocab = lv.shape
    iv = check_token_ids(as_view(token_ids, name="token_ids", stream=handle), batch, device)
    lpv = as_view(out_logprobs, name="out_logprobs", stream=handle)
    check_view(lpv, name="out_logprobs", dtypes=("float32",), device=device, ndim=1, length=batch, writable=True)
    rkv = as_view(out_ranks, name="out_ranks", stream=handle)
    check_view(rkv, name="out_ranks", dtypes=RANK_DTYPES, device=device, ndim=1, length=batch, writable=True)
    top_k = check_top_k(top_k, vocab)
    tlpv = (
        as_view(out_topk_logprobs, name="out_topk_logprobs", stream=handle) if out_topk_logprobs is not None else None
    )
    tidv = as_view(out_topk_ids, name="out_topk_ids", stream=handle) if out_topk_ids is not None else None
    check_topk_outputs(tlpv, tidv, batch, top_k, device)
    amv = None
    if out_argmax is not None:
        amv = as_view(out_argmax, name="out_argmax", stream=handle)
        check_view(amv, name="out_argmax", dtypes=RANK_DTYPES, device=device, ndim=1, length=batch, writable=True)
    env = None
    if out_entropy is not None:
        env = as_view(out_entropy, name="out_entropy", stream=handle)
        check_view(env, name="out_entropy", dtypes=("float32",), device=device, ndim=1, length=batch, writable=True)
    tv = None
    if temperature is not None:
        tv = check_temperature(as_view(temperature, name="temperature", stream=handle), batch, device)
    outputs = [
        ("out_logprobs", lpv),
        ("out_ranks", rkv),
        ("out_topk_logprobs", tlpv),
        ("out_topk_ids", tidv),
        ("out_argmax", amv),
        ("out_entropy", env),
    ]
    inputs = [("logits", lv), ("token_ids", iv), ("temperature", tv)]
    _check_sets(outputs, inputs, bound, device, workspace, handle)
    if device == CPU:
        return ((lv, iv, tv, lpv, rkv, tlpv, tidv, top_k, amv, env), None, None, handle) if batch else None
    if lv.device_type != "cuda":
        raise ValueError(f"logits must be in host memory or on a CUDA device (got {lv.device})")
    need = _workspace_bytes(batch, vocab, top_k)
    if workspace is None:
        if need:
            raise ValueError(
                f"workspace must be given on a GPU: this call needs {need} bytes of device scratch "
                f"(logprob_rank_workspace_bytes({batch}, {vocab}, {top_k}))"
            )
        return None
    wsv = check_workspace(as_view(workspace, name="workspace", stream=handle), device, need)
    check_disjoint([("workspace", wsv)], outputs + inputs)  # the rest checked above
    if batch == 0:
        return None
    from .kernels.logprob_rank import LogprobRankArgs, LogprobRankDtypes, plan_logprob_rank

    n_chunks = plan_logprob_rank(batch, vocab, lv.dtype, top_k).n_chunks
    if n_chunks * batch > INT32_MAX:
        raise ValueError(
            f"logits has too many rows for one call (got shape {[batch, vocab]}; at most "
            f"{INT32_MAX // n_chunks} rows at this vocabulary)"
        )
    # One row: its stride only tells the alignment of the layout (never used to address).
    row_stride = lv.strides[0] if 0 <= lv.strides[0] <= INT32_MAX else 0
    args = LogprobRankArgs(
        lv.ptr,
        iv.ptr,
        tv.ptr if tv is not None else 0,
        lpv.ptr,
        rkv.ptr,
        tlpv.ptr if tlpv is not None else 0,
        tidv.ptr if tidv is not None else 0,
        wsv.ptr,
        batch,
        vocab,
        row_stride,
        top_k,
        amv.ptr if amv is not None else 0,
        env.ptr if env is not None else 0,
    )
    dtypes = LogprobRankDtypes(
        lv.dtype,
        iv.dtype,
        rkv.dtype,
        tidv.dtype if tidv is not None else "int32",
        amv.dtype if amv is not None else "int32",
    )
    views = (lv, iv, tv, lpv, rkv, tlpv, tidv, wsv, amv, env)
    return views, args, dtypes, handle


def _check_sets(outputs, inputs, bound, device, workspace, handle) -> None:
    """What the forward and the backward check of their arrays as sets: no output overlaps
    another or an input; a bound call takes no copied input; on the CPU, a workspace given is
    only checked (the numpy backend needs none)."""
    check_disjoint(outputs, inputs)
    if bound:
        check_not_copied(inputs)
    if device == CPU and workspace is not None:
        check_workspace(as_view(workspace, name="workspace", stream=handle), device, 0)


# -- the backward call --------------------------------------------------------------------------
def validated_backward_call(
    logits,
    token_ids,
    logprobs,
    out_grad_logits,
    stream,
    grad_logprobs,
    temperature,
    out_grad_temperature,
    argmax,
    topk_ids,
    topk_logprobs,
    grad_topk_logprobs,
    entropy,
    grad_entropy,
    workspace,
    bound=False,
):
    """Every check of a backward call: ``(numpy call or None, kernel args or None, kernel dtypes,
    views)``; both None when there is nothing to compute. ``bound``: the call is bound, its inputs
    may not be copies (the outputs never may)."""
    handle = stream_handle(stream)

    def view(value, name):
        return None if value is None else as_view(value, name=name, stream=handle)

    lv = check_logits(as_view(logits, name="logits", stream=handle))
    device, (batch, vocab) = lv.device, lv.shape
    iv = check_token_ids(as_view(token_ids, name="token_ids", stream=handle), batch, device)

    def vector(value, name, dtypes=("float32",), writable=False):
        v = view(value, name)
        if v is not None:
            check_view(v, name=name, dtypes=dtypes, device=device, ndim=1, length=batch, writable=writable)
        return v

    if logprobs is None:  # the kernels recover each row's normaliser from it: never optional
        raise ValueError(f"logprobs must be given: the forward's [batch] float32 logprobs (got {logprobs!r})")
    lpv = vector(logprobs, "logprobs")
    glv = vector(grad_logprobs, "grad_logprobs")
    tv = None if temperature is None else check_temperature(view(temperature, "temperature"), batch, device)
    amv = vector(argmax, "argmax", RANK_DTYPES)
    env, gev = vector(entropy, "entropy"), vector(grad_entropy, "grad_entropy")
    if gev is not None and env is None:
        raise ValueError("entropy must be given with grad_entropy (the forward's entropy output, float32 [batch])")
    gtv = vector(out_grad_temperature, "out_grad_temperature", writable=True)
    if gtv is not None and tv is None:
        raise ValueError("out_grad_temperature needs temperature (a call without one has no temperature gradient)")
    tidv, tlpv, gtkv = (
        view(topk_ids, "topk_ids"),
        view(topk_logprobs, "topk_logprobs"),
        view(grad_topk_logprobs, "grad_topk_logprobs"),
    )
    top_k = _backward_top_k(tidv, tlpv, gtkv, batch, vocab, device)
    gv = as_view(out_grad_logits, name="out_grad_logits", stream=handle)
    check_view(gv, name="out_grad_logits", dtypes=(lv.dtype,), device=device, ndim=2, writable=True, contiguous=False)
    if tuple(gv.shape) != (batch, vocab):
        raise ValueError(f"out_grad_logits must have the logits' shape {[batch, vocab]} (got shape {list(gv.shape)})")
    if batch > 1 and ((vocab > 1 and gv.strides[1] != 1) or not vocab <= gv.strides[0] <= INT32_MAX):
        raise ValueError(
            f"out_grad_logits must not have overlapping rows: element stride 1 along the vocabulary and a row "
            f"stride between {vocab} (the vocabulary) and {INT32_MAX} elements (got element strides {list(gv.strides)})"
        )
    inputs = [("logits", lv), ("token_ids", iv), ("logprobs", lpv), ("grad_logprobs", glv), ("temperature", tv)]
    inputs += [("argmax", amv), ("topk_ids", tidv), ("topk_logprobs", tlpv), ("grad_topk_logprobs", gtkv)]
    inputs += [("entropy", env), ("grad_entropy", gev)]
    outputs = [("out_grad_logits", gv), ("out_grad_temperature", gtv)]
    _check_sets(outputs, inputs, bound, device, workspace, handle)
    if device == CPU:
        views = (lv, iv, amv, tv, lpv, glv, tidv, tlpv, gtkv, env, gev, gv, gtv)
        return (lambda _stream: logprob_backward_numpy(*views)) if batch else None, None, None, views
    if lv.device_type != "cuda":
        raise ValueError(f"logits must be in host memory or on a CUDA device (got {lv.device})")
    from .kernels.logprob_backward import LogprobBackwardArgs, LogprobBackwardDtypes, backward_workspace_bytes

    need = backward_workspace_bytes(batch, vocab, gtv is not None)
    wsv = None
    if need:
        if workspace is None:
            raise ValueError(
                f"workspace must be given on a GPU with out_grad_temperature: this call needs {need} bytes "
                f"(logprob_backward_workspace_bytes({batch}, {vocab}, True))"
            )
        wsv = check_workspace(as_view(workspace, name="workspace", stream=handle), device, need)
        check_disjoint([("workspace", wsv)], outputs + inputs)  # the rest checked above
    if batch == 0:
        return None, None, None, ()

    def ptr(v: ArrayView | None) -> int:
        return 0 if v is None else v.ptr

    args = LogprobBackwardArgs(
        lv.ptr, iv.ptr, ptr(amv), ptr(tv), ptr(lpv), ptr(glv), ptr(tidv), ptr(tlpv), ptr(gtkv), ptr(env), ptr(gev),
        gv.ptr, ptr(gtv), ptr(wsv), batch, vocab,
        lv.strides[0] if batch > 1 else vocab, gv.strides[0] if batch > 1 else vocab, top_k,
    )  # fmt: skip
    dtypes = LogprobBackwardDtypes(
        lv.dtype, iv.dtype, amv.dtype if amv is not None else "int32", tidv.dtype if tidv is not None else "int32"
    )
    views = (lv, iv, amv, tv, lpv, glv, tidv, tlpv, gtkv, env, gev, gv, gtv, wsv)
    return None, args, dtypes, views


def _backward_top_k(ids, lps, grads, batch: int, vocab: int, device: str) -> int:
    """``top_k`` of the forward's top-k outputs (0 without), checked: both or neither, shapes."""
    if (ids is None) != (lps is None):
        raise ValueError(
            "topk_ids and topk_logprobs must be given together (the forward's top-k outputs) or not at all"
        )
    if ids is None:
        if grads is not None:
            raise ValueError("grad_topk_logprobs needs topk_ids and topk_logprobs (the forward's top-k outputs)")
        return 0
    for name, v, dtypes in (("topk_ids", ids, RANK_DTYPES), ("topk_logprobs", lps, ("float32",))):
        check_view(v, name=name, dtypes=dtypes, device=device, ndim=2, length=batch)
    top_k = ids.shape[1]
    limit = min(LOGPROB_TOPK_MAX, vocab)
    if not 1 <= top_k <= limit:
        raise ValueError(f"topk_ids must have between 1 and {limit} columns (got shape {list(ids.shape)})")
    for name, v in (("topk_logprobs", lps), ("grad_topk_logprobs", grads)):
        if v is not None:
            check_view(v, name=name, dtypes=("float32",), device=device, ndim=2, length=batch)
            if tuple(v.shape) != (batch, top_k):
                raise ValueError(f"{name} must have shape {[batch, top_k]} (as topk_ids) (got shape {list(v.shape)})")
    return top_k
