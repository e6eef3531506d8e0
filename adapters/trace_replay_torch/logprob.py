"""``token_logprob_rank`` for torch tensors: logprob and rank of one token per row, one read of the logits.

Runs :func:`trace_replay_core.token_logprob_rank` on torch's current stream of the logits'
device (or in numpy for CPU tensors); no host synchronisation, capturable in a CUDA graph
once warmed up. Calls are bound once per layout of their tensors (data pointers, dtypes,
shapes, strides; torch's caching allocator hands a decode loop the same few addresses step
after step), so a repeated call only launches the kernels.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from trace_replay_core import bind_logprob_rank
from trace_replay_core import token_logprob_rank as core_token_logprob_rank
from trace_replay_core._bound_cache import BoundCache
from trace_replay_core._logprob import logprob_rank_workspace_bytes

from .views import layout_key, raw_stream

__all__ = ["token_logprob_rank"]


_workspace_bytes = functools.lru_cache(maxsize=256)(logprob_rank_workspace_bytes)
_BOUND = BoundCache(64)     # bound calls by tensor layout


def _bound(logits, token_ids, logprobs, ranks, workspace, stream):
    """The bound call for this exact layout of tensors, binding (over DLPack) on a miss."""
    tensors = (logits, token_ids, logprobs, ranks) if workspace is None else (
        logits, token_ids, logprobs, ranks, workspace)

    def bind():
        t = tuple(x.detach() for x in tensors)           # logits may require grad: read-only use
        return bind_logprob_rank(t[0], t[1], out_logprobs=t[2], out_ranks=t[3], stream=stream,
                                 workspace=t[4] if workspace is not None else None)

    return _BOUND.bind(tuple(layout_key(t) for t in tensors), bind)


def token_logprob_rank(logits: torch.Tensor, token_ids: torch.Tensor, *,
                       out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and rank of ``token_ids[b]`` under row ``b`` of ``logits``.

    ``logits``: ``[batch, vocab]`` float32, bfloat16 or float16, rows may be strided (element
    stride 1 along the vocabulary), never modified. ``token_ids``: ``[batch]`` or
    ``[batch, 1]`` int32/int64 on the same device (e.g. ``sampled`` after replay).

    Returns ``(logprobs, ranks)``: ``logprobs`` float32 ``[batch]`` (natural log of the softmax
    probability, accumulated in float32), ``ranks`` ``[batch]`` = the number of vocabulary
    entries whose logit is greater than or equal to the token's own (vLLM's definition: a
    unique argmax has rank 1; ties count against the token). New tensors (``ranks`` int64)
    unless ``out=(logprobs, ranks)`` gives caller-owned ones (float32 and int32/int64, ``[batch]``,
    contiguous), which are written and returned.

    Special values: a row holding a NaN or ``+inf``, or only ``-inf`` logits, has logprob NaN
    (ranks are IEEE counts: NaN entries never count); ``-inf`` logits are otherwise fine; a
    token id outside ``[0, vocab)`` gives logprob NaN and rank -1 (no error: that check would
    need a host sync).

    Blocking: ordered on torch's current stream of the logits' device, never synchronises. For
    batches below 256 it allocates a workspace of at most 6 KiB with torch (so it is
    capture-safe through torch's graph memory pool). The first call per device and dtype
    combination compiles the kernels: run one eager call before capturing a CUDA graph.
    On CPU tensors it computes in numpy before returning.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (got {type(logits).__name__})")
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor (got {type(token_ids).__name__})")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab] (got shape {list(logits.shape)})")
    device = logits.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"logits must be on a cpu or cuda device (got {device})")
    batch, vocab = logits.shape
    if out is None:
        logprobs = torch.empty(batch, dtype=torch.float32, device=device)
        ranks = torch.empty(batch, dtype=torch.int64, device=device)
    else:
        if (not isinstance(out, (tuple, list)) or len(out) != 2
                or not all(isinstance(t, torch.Tensor) for t in out)):
            got = ([type(t).__name__ for t in out] if isinstance(out, (tuple, list)) else type(out).__name__)
            raise TypeError(f"out must be a (logprobs, ranks) pair of torch.Tensor (got {got})")
        logprobs, ranks = out
    if device.type == "cpu":
        # The numpy backend computes at once (and a CPU tensor's memory is reused freely: no cache).
        core_token_logprob_rank(logits.detach(), token_ids, out_logprobs=logprobs, out_ranks=ranks, stream=0)
        return logprobs, ranks
    stream = raw_stream(device.index)
    workspace = None
    nbytes = _workspace_bytes(batch, vocab) if vocab >= 1 else 0
    if nbytes:
        # Freed when this call returns: torch reuses it only for work queued after ours.
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _bound(logits, token_ids, logprobs, ranks, workspace, stream)(stream=stream)
    return logprobs, ranks
