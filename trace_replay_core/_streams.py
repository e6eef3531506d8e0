"""Explicit CUDA streams: what callers may pass as ``stream=`` and how it becomes a handle."""

from __future__ import annotations

from typing import Any

__all__ = ["stream_handle"]


def stream_handle(stream: Any, *, name: str = "stream") -> int:
    """Return the raw ``CUstream`` handle (int) for ``stream``.

    Accepted: a non-negative int handle (0 is the legacy default stream, 2 the per-thread
    default stream) or an object with ``__cuda_stream__()`` returning ``(version, handle)``.
    ``None`` is refused: every stream-ordered call names its stream.
    """
    if stream is None:
        raise TypeError(
            f"{name} must be given explicitly: an int CUDA stream handle or an object with "
            f"__cuda_stream__ (got None); pass 0 for the legacy default stream"
        )
    if isinstance(stream, bool):
        raise TypeError(
            f"{name} must be an int CUDA stream handle or an object with __cuda_stream__ (got bool {stream!r})"
        )
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"{name} must be a non-negative CUDA stream handle (got {stream})")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        try:
            _, handle = value
            return int(handle)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}.__cuda_stream__ must give (version, handle) (got {value!r})") from exc
    raise TypeError(
        f"{name} must be an int CUDA stream handle or an object with __cuda_stream__ (got {type(stream).__name__})"
    )
