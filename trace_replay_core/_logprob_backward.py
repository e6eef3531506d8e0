"""``token_logprob_rank_backward``: the gradient of ``token_logprob_rank``'s logprobs, top-k
logprobs and entropy with respect to the logits (and the temperature), one read of the logits
and one write of the gradient, batch-invariant.

Example (CPU backend; on a GPU pass device arrays and a stream handle)::

    import numpy as np
    from trace_replay_core import token_logprob_rank, token_logprob_rank_backward

    logits = np.array([[2.0, 1.0, 0.5]], dtype=np.float32)
    ids = np.array([1], dtype=np.int64)
    lp, rk = np.empty(1, np.float32), np.empty(1, np.int64)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    grad = np.empty_like(logits)
    token_logprob_rank_backward(logits, ids, lp, grad_logprobs=np.ones(1, np.float32),
                                out_grad_logits=grad, stream=0)
    p = np.exp(logits[0] - np.log(np.exp(logits[0]).sum()))
    assert np.allclose(grad[0], np.eye(3)[1] - p, atol=1e-6)      # one-hot minus softmax
"""

from __future__ import annotations

from typing import Any

from ._dlpack import ArrayView, without_capsules
from ._logprob import BoundLogprobRank
from ._logprob_checks import check_workspace_shape, validated_backward_call
from ._numpy_backend import logprob_backward_numpy
from ._streams import stream_handle

__all__ = [
    "token_logprob_rank_backward",
    "bind_logprob_rank_backward",
    "BoundLogprobBackward",
    "logprob_backward_workspace_bytes",
]


def logprob_backward_workspace_bytes(batch: int, vocab: int, grad_temperature: bool = False) -> int:
    """Bytes of device workspace a ``[batch, vocab]`` backward needs (host-only, pure): 0 without
    ``out_grad_temperature``; with it, 4 bytes per chunk of each row (96 bytes per row at vocab
    151,936). Errors (``TypeError``/``ValueError``) name the argument: ``batch >= 0``, ``1 <=
    vocab <= MAX_VOCAB``, ``grad_temperature`` a bool."""
    from .kernels.logprob_backward import backward_workspace_bytes

    batch, vocab = check_workspace_shape(batch, vocab)
    if type(grad_temperature) is not bool:
        raise TypeError(f"grad_temperature must be True or False (got {grad_temperature!r})")
    return backward_workspace_bytes(batch, vocab, grad_temperature)


def token_logprob_rank_backward(
    logits: Any,
    token_ids: Any,
    logprobs: Any,
    *,
    out_grad_logits: Any,
    stream: Any,
    grad_logprobs: Any = None,
    temperature: Any = None,
    out_grad_temperature: Any = None,
    argmax: Any = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    grad_topk_logprobs: Any = None,
    entropy: Any = None,
    grad_entropy: Any = None,
    workspace: Any = None,
) -> None:
    """Write ``out_grad_logits[b, j] = dL/dlogits[b, j]`` (and ``out_grad_temperature[b] = dL/dT_b``)
    for ``L = sum_b grad_logprobs[b] * logprobs[b] + sum grad_topk_logprobs * topk_logprobs +
    sum_b grad_entropy[b] * entropy[b]``, the outputs of a :func:`token_logprob_rank` call with the
    same ``logits``, ``token_ids``, ``temperature`` (and ``out_argmax`` as ``argmax``).

    With ``y = logits[b] / T``, ``p = softmax(y)``: ``d logprob / dy_j = [j == t] - p_j``, the same
    for each top-k logprob at its id, ``d entropy / dy_j = -p_j (log p_j + entropy)``; ``dL/dlogits
    = dL/dy / T`` and ``dL/dT = -(1 / T) sum_j dL/dy_j (y_j - lse)`` (for the logprob: ``(E_p[y] -
    y_t) / T``). Computed in float32; ``out_grad_logits`` holds them in the logits' dtype. The
    row's log-normaliser comes from the forward's outputs (the top-1 logprob when ``topk_ids`` and
    ``topk_logprobs`` are given, else the token's logprob), not from a second read of the row
    (:mod:`.kernels.logprob_backward` says why and how exact); a row with neither finite reduces
    its row again.

    Special rows: a row whose id is out of range (with ``argmax``, a negative id is the greedy
    token ``argmax[b]``) has a constant logprob (NaN): it adds no gradient, and a row with no
    other gradient gets zeros. A row without a finite normaliser (a NaN or ``+inf`` logit, only
    ``-inf`` logits, a temperature not finite and ``> 0``) gets NaN in every column and in
    ``out_grad_temperature``. A ``-inf`` logit gets gradient 0 (``-p = 0``) unless it is the token.

    Batch-invariant: a row's gradients have the same bits whatever the batch, the row's position
    and the other rows (the order of every reduction is fixed by the vocabulary alone); the CPU
    backend (numpy, row by row) is too, with other bits than the GPU's.

    Parameters
    ----------
    logits, token_ids, temperature, argmax:
        As given to (``argmax``: as written by) the forward call: ``[batch, vocab]`` float32,
        bfloat16 or float16 (rows may be strided); ``[batch]`` or ``[batch, 1]`` int32/int64;
        optional ``[batch]`` float32; optional ``[batch]`` int32/int64. Read only.
    logprobs, topk_ids, topk_logprobs, entropy:
        The forward's outputs (``[batch]`` float32, required; ``[batch, top_k]`` int32/int64 and
        float32, both or neither; ``[batch]`` float32, required with ``grad_entropy``).
    grad_logprobs, grad_topk_logprobs, grad_entropy:
        Upstream gradients, float32, shaped as their outputs; ``None``: zero (``grad_topk_logprobs``
        needs the top-k outputs, ``grad_entropy`` needs ``entropy``).
    out_grad_logits:
        Caller-owned ``[batch, vocab]`` output in the logits' dtype, element stride 1 along the
        vocabulary (rows may be strided, at least ``vocab`` elements apart: rows must not
        overlap), writable; every element is written.
    out_grad_temperature:
        Optional caller-owned ``[batch]`` float32 output (needs ``temperature``); every row written.
    stream:
        Keyword-only, required: an int CUDA stream handle or an object with ``__cuda_stream__``;
        host arrays compute at once in numpy and the stream is only validated.
    workspace:
        Device scratch the caller owns, 16-byte aligned, at least
        :func:`logprob_backward_workspace_bytes` bytes (0 without ``out_grad_temperature``: may be
        omitted then); ignored on the CPU backend.

    Blocking and ownership: on a GPU the call is stream-ordered: it queues one kernel (two with
    ``out_grad_temperature``) on ``stream`` and returns; it allocates nothing, so it may be
    captured in a CUDA graph once compiled (the first call per device and signature compiles,
    host-blocking). The arrays must stay alive until the queued work has run; the outputs must
    not overlap the inputs or each other. On the CPU backend the call computes before it returns.
    Errors name the argument and what was received; a rejected call writes nothing. On a GPU a
    CUDA driver call that fails (the launch, the first call's kernel load) raises
    :class:`~trace_replay_core.CudaError`.
    """
    numpy_call, args, dtypes, views = validated_backward_call(
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
    )
    if numpy_call is not None:
        numpy_call(0)
    elif args is not None:
        from . import _cuda
        from .kernels.logprob_backward import launch_logprob_backward

        device_id = views[0].device_id
        with _cuda.on_device(device_id):  # the caller's current context is restored afterwards
            launch_logprob_backward(args, dtypes, device_id, stream_handle(stream))


class BoundLogprobBackward(BoundLogprobRank):
    """A :func:`token_logprob_rank_backward` call whose arrays were validated and fixed by
    :func:`bind_logprob_rank_backward`.

    ``bound(stream=s)`` queues the call on stream ``s`` and returns: one kernel launch (two with
    ``out_grad_temperature``), no validation, no DLPack, stream-ordered, never blocking;
    capturable in a CUDA graph (a failing launch raises :class:`~trace_replay_core.CudaError`).
    On the CPU backend it computes in numpy before returning. ``views`` holds the validated
    arrays (their DLPack capsules keep the memory alive while the object lives);
    :meth:`release` drops them, as for the forward's :class:`BoundLogprobRank`.
    """

    __slots__ = ()


def bind_logprob_rank_backward(
    logits: Any,
    token_ids: Any,
    logprobs: Any,
    *,
    out_grad_logits: Any,
    stream: Any,
    grad_logprobs: Any = None,
    temperature: Any = None,
    out_grad_temperature: Any = None,
    argmax: Any = None,
    topk_ids: Any = None,
    topk_logprobs: Any = None,
    grad_topk_logprobs: Any = None,
    entropy: Any = None,
    grad_entropy: Any = None,
    workspace: Any = None,
) -> BoundLogprobBackward:
    """Validate the arrays of a :func:`token_logprob_rank_backward` call once and return a
    :class:`BoundLogprobBackward` that repeats exactly that call: ``bound(stream=s)`` queues the
    kernels on ``s`` (one or two launches, no validation, no DLPack; stream-ordered, capturable in
    a CUDA graph), or computes in numpy on the CPU backend. Arguments and errors as
    :func:`token_logprob_rank_backward`, and an input whose producer exported a copy over DLPack
    is refused (the bound call keeps its pointer); ``stream`` is used for the DLPack handshake here.
    Host-blocking only when it compiles the kernels (the first time for a device and signature).
    """
    numpy_call, args, dtypes, views = validated_backward_call(
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
        bound=True,
    )
    kept = tuple(v for v in views if isinstance(v, ArrayView))
    if args is None:
        if numpy_call is None:
            return BoundLogprobBackward(None, kept)
        cpu = without_capsules(views)  # the launch keeps pointers: release() lets the arrays go
        return BoundLogprobBackward(lambda _stream: logprob_backward_numpy(*cpu), kept)
    from . import _cuda
    from .kernels.logprob_backward import bind_logprob_backward_launch

    device_id = views[0].device_id
    with _cuda.on_device(device_id):
        launch = bind_logprob_backward_launch(args, dtypes, device_id)
    return BoundLogprobBackward(launch, kept)
