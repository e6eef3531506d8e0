"""Where a JAX run's parameters go: the family's parameter pytree on one device or over a mesh,
and a device's free memory."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["device_params", "free_bytes", "placed_params"]


def device_params(family: Any, config: Any, weights: Mapping[str, np.ndarray], dev: Any, dtype: Any) -> Any:
    """The family's parameter pytree on ``dev`` in ``dtype`` (copies)."""
    put = functools.partial(jax.device_put, device=dev)
    return jax.tree.map(lambda w: put(w).astype(dtype), family.params(config, weights, False))


def free_bytes(device: Any) -> int | None:
    """Free bytes on a JAX ``device`` (``bytes_limit - bytes_in_use`` of its memory stats);
    ``None`` where the device reports none (the CPU): nothing is checked."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def placed_params(family: Any, config, weights: Mapping[str, np.ndarray], mesh: Mesh, vocab_axis: str, dtype):
    """The parameter pytree on ``mesh`` in ``dtype``: ``head`` (``[hidden, vocab]``) sharded
    along the vocabulary over ``vocab_axis``, everything else replicated. Copies; the caller's
    arrays are not changed."""
    host = family.params(config, weights, True)
    head = host.pop("head")
    params = jax.tree.map(lambda w: jax.device_put(w, NamedSharding(mesh, P())).astype(dtype), host)
    params["head"] = jax.device_put(head, NamedSharding(mesh, P(None, vocab_axis))).astype(dtype)
    return params
