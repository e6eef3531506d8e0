"""Device names: the one parser of ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or an int N.

Adapters and the application hand their device over as one of these (a ``torch.device`` as its
string, a JAX device as ``"cuda:<local id>"``) and get back the same normal form and the same
errors.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_device", "split_device", "default_device"]

_FORMS = "'cpu', 'cuda', 'cuda:N' or an int"


def split_device(device: Any) -> tuple[str, int]:
    """``(kind, index)`` of a device name, without asking the driver: ``("cpu", 0)`` or
    ``("cuda", N)`` (``"cuda"`` is ``("cuda", 0)``). Raises ``TypeError``/``ValueError`` naming
    the value for anything else. Pure, host-only."""
    if isinstance(device, bool):
        raise TypeError(f"device must be {_FORMS} (got bool {device!r})")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be {_FORMS} >= 0 (got {device})")
        return "cuda", device
    if not isinstance(device, str):
        raise TypeError(f"device must be {_FORMS} (got {type(device).__name__})")
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    kind, sep, index = device.partition(":")
    if kind != "cuda" or not sep or not index.isdigit():
        raise ValueError(f"device must be {_FORMS} (got {device!r})")
    return "cuda", int(index)


def parse_device(device: Any) -> str:
    """Normalise a device name to ``"cpu"`` or ``"cuda:N"``, checking that CUDA device N exists.

    ``"cuda"`` means ``"cuda:0"``. On a machine without CUDA (or with fewer devices), ``"cuda"``
    and ``"cuda:N"`` raise the same ``ValueError``, which says how many devices this process
    sees and that ``device="cpu"`` selects the numpy backend. Host-only.
    """
    kind, index = split_device(device)
    if kind == "cpu":
        return "cpu"
    from ._cuda import gpu_count

    count = gpu_count()
    if index >= count:
        raise ValueError(
            f"device {device!r} is not available: this process sees {count} CUDA device(s); "
            f"use device='cpu' for the CPU backend"
        )
    return f"cuda:{index}"


def default_device() -> str:
    """``"cuda:0"`` when a CUDA device is visible, else ``"cpu"``. Host-only."""
    from ._cuda import gpu_count

    return "cuda:0" if gpu_count() > 0 else "cpu"
