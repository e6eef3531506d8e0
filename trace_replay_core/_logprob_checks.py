"""Every check of a ``token_logprob_rank`` call, on the host, before anything is launched: the
arrays' views, dtypes, shapes, devices and overlaps, the temperature and the workspace size. A
rejected call raises here and changes nothing."""

from __future__ import annotations

from ._dlpack import CPU, as_view
from ._dtypes import RANK_DTYPES
from ._streams import stream_handle
from ._validate import (
    INT32_MAX,
    check_disjoint,
    check_logits,
    check_temperature,
    check_token_ids,
    check_top_k,
    check_topk_outputs,
    check_view,
    check_workspace,
    check_workspace_shape,
)


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
):
    """Every check of a call: ``None`` when there is nothing to compute (empty batch), else
    ``(numpy backend arguments, kernel args or None, kernel dtypes or None, stream)``; the
    kernel args are None on the CPU backend."""
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
    check_disjoint(outputs, inputs)
    if device == CPU:
        if workspace is not None:
            check_workspace(as_view(workspace, name="workspace", stream=handle), device, 0)
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
