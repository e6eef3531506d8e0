"""What the torch adapter's modules share: the layout key of a tensor, and torch's current stream.

A layout key (data pointer, dtype, shape, strides) describes a tensor's memory completely: the
adapter binds a launch once per key (:class:`trace_replay_core.BoundCache`) instead of
exporting tensors over DLPack every call, which costs torch tens of microseconds per CUDA
tensor (it builds an external stream object and may record an event).
"""

from __future__ import annotations

import torch

__all__ = ["layout_key", "raw_stream", "FUNCTORCH_ACTIVE"]

# Whether a ``torch.func`` transform (vmap, grad, ...) is active (None where torch lacks the query):
# its wrapped tensors have no storage to hand over, so a call goes through the registered op,
# which has rules for them.
FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)

try:  # ~0.2 us instead of ~2 us for torch.cuda.current_stream(...).cuda_stream
    from torch._C import _cuda_getCurrentRawStream as raw_stream
except ImportError:  # pragma: no cover - older or CPU-only builds

    def raw_stream(index: int) -> int:
        """The raw handle of torch's current stream on CUDA device ``index``."""
        return torch.cuda.current_stream(index).cuda_stream


def layout_key(t: torch.Tensor):
    """``(data pointer, dtype, shape, strides)`` of ``t``: equal keys describe the same memory."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride())
