"""Where a :class:`~trace_replay_jax.TraceReplayState` lives: one JAX device, or a mesh of them.

``device=`` names one device (``None``: JAX's default device at that moment, as
``jax.default_device(...)`` and the ``jax_default_device`` setting make it; a ``jax.Device``;
``"cpu"``, ``"cuda"``, ``"cuda:N"``). ``mesh=`` takes a ``jax.sharding.Mesh``: the state then keeps one core table
per device of the mesh that this process drives (``mesh.local_devices``), all holding the same
traces, and hands out its tables as global arrays replicated over the whole mesh.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.backend import get_default_device
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_replay_core import split_device

__all__ = ["resolve_device", "resolve_placement", "core_device"]


def resolve_device(device: Any) -> jax.Device:
    """``None`` (JAX's default device: the one ``jax.default_device(...)`` or the
    ``jax_default_device`` setting names where one does, else the first local device of the
    default backend, where JAX itself puts new arrays), a ``jax.Device``, ``"cpu"``,
    ``"cuda"``/``"gpu"`` or ``"cuda:N"``/``"gpu:N"`` (N = CUDA device ordinal) -> a
    ``jax.Device`` (host-only).

    ``ValueError`` naming ``device`` when JAX has no such device (no gpu backend, or no CUDA
    device of that ordinal: the message lists those it sees) or it is not a CPU or CUDA device;
    ``TypeError`` for another type. What ``TraceReplayState(device=...)`` uses.
    """
    if device is None:
        device = get_default_device()  # jax.extend's reading of jax_default_device (a device or a platform)
    elif isinstance(device, str):
        try:  # the core's one device parser ("gpu" is JAX's name for cuda)
            kind, ordinal = split_device("cuda" + device[3:] if device.startswith("gpu") else device)
        except ValueError:
            raise ValueError(f"device must be a jax.Device, 'cpu', 'cuda', 'cuda:N' or None (got {device!r})") from None
        platform = "cpu" if kind == "cpu" else "gpu"
        try:
            devices = jax.devices(platform)
        except RuntimeError as exc:
            raise ValueError(
                f"device {device!r} is not available: JAX has no {platform} backend here ({exc}); use device='cpu'"
            ) from exc
        if kind == "cpu":
            device = devices[0]
        else:
            wanted = ordinal
            match = [d for d in devices if getattr(d, "local_hardware_id", d.id) == wanted]
            if not match:
                raise ValueError(
                    f"device {device!r} is not available: JAX sees CUDA devices "
                    f"{[getattr(d, 'local_hardware_id', d.id) for d in devices]}"
                )
            device = match[0]
    elif not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device, 'cpu', 'cuda', 'cuda:N' or None (got {type(device).__name__})")
    _check_platform(device)
    return device


def _check_platform(device: jax.Device) -> None:
    if device.platform not in ("cpu", "gpu"):
        raise ValueError(f"device must be a CPU or CUDA GPU device (got {device.platform} device {device})")


def resolve_placement(device: Any, mesh: Any) -> tuple[tuple[jax.Device, ...], NamedSharding | None]:
    """``(devices, sharding)``: the local devices that get a core table, and the replicated
    sharding of the tables over ``mesh`` (``None`` for a single device)."""
    if mesh is None:
        return (resolve_device(device),), None
    if device is not None:
        raise ValueError(f"give device or mesh, not both (got device={device!r} and a mesh)")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (got {type(mesh).__name__})")
    devices = tuple(mesh.local_devices)
    if not devices:
        raise ValueError(f"mesh has no device that this process drives (mesh devices: {mesh.devices.tolist()})")
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"mesh mixes platforms {sorted(platforms)}: use devices of one platform")
    for d in devices:
        _check_platform(d)
    return devices, NamedSharding(mesh, PartitionSpec())


def core_device(device: jax.Device) -> str:
    """The core's name of ``device``: ``"cuda:N"`` (N = its CUDA ordinal) or ``"cpu"``."""
    return f"cuda:{device.local_hardware_id}" if device.platform == "gpu" else "cpu"
