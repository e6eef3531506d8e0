"""Zero-copy JAX views of memory the trace table owns, through DLPack.

The core's :class:`~trace_replay_core.ArrayView` exports itself as a DLPack capsule whose
deleter frees only the small descriptor: when JAX drops the view, nothing else is freed. The
data stays owned by the :class:`~trace_replay_core.TraceTable`, which must outlive the view;
:class:`~trace_replay_jax.TraceReplayState` deletes its views before it frees the table.

Ordering: the table has finished every write to the memory before the view is made (it is
built and cleared host-blocking), so the DLPack ``stream=`` JAX passes needs no wait. Later
writes happen on XLA's own stream (see ``commit.py``).
"""

from __future__ import annotations

import jax

from trace_replay_core import ArrayView, TraceTable

from .jnp_replay import ReplayTables

__all__ = ["jax_view", "table_views"]


def table_views(core: TraceTable) -> ReplayTables:
    """Zero-copy JAX views of a GPU ``core``'s table and trace lengths, made after every write
    to them has landed (host-blocking: construction only)."""
    # Compile the scatter kernel now (a no-op commit that clears slot 0, already clear), so
    # that the first commit inside XLA does not compile; then let every write land.
    core.clear(0)
    core.commit(stream=0)
    core.synchronize()
    table_view, lengths_view = core.device_views()
    try:
        table = jax_view(table_view)
    except Exception as exc:
        if core.placement != "host_mapped":
            raise
        raise ValueError(
            f"placement='host_mapped' is not usable with this JAX: it could not view the "
            f"host-mapped table ({exc}); use placement='device'"
        ) from exc
    return ReplayTables(table, jax_view(lengths_view))


def jax_view(view: ArrayView) -> jax.Array:
    """A ``jax.Array`` over the memory ``view`` describes (not a copy); host-only.

    Raises when JAX would have copied instead of viewing (JAX needs compact, aligned memory).
    """
    array = jax.dlpack.from_dlpack(view, copy=False)
    if array.unsafe_buffer_pointer() != view.ptr:
        raise RuntimeError(
            f"JAX copied the memory instead of viewing it (0x{view.ptr:x} -> "
            f"0x{array.unsafe_buffer_pointer():x}); it must be compact and aligned"
        )
    return array
