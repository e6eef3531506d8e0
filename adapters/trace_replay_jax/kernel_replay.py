"""Replay with ``method="kernel"``: the core's Triton replay kernel, run by XLA on its own stream.

The same compiled kernel the torch adapter launches, reached through the core's public
:meth:`trace_replay_core.TraceTable.bind_replay`. XLA calls it through
``jax.experimental.buffer_callback``: the callback receives XLA's buffers (the table, its
lengths, ``sampled``, ``idx_mapping`` and the step source), with the output aliased to
``sampled`` (XLA copies ``sampled`` first when the caller still needs it), and queues one
kernel launch on ``ctx.stream`` that overwrites the traced rows of the output in place.
Nothing waits for the device.

Why this mechanism: measured on an H200 (2026-11-30), a command-buffer-compatible
``buffer_callback`` was the cheapest way to run a foreign kernel inside a jitted step (+3.4 us
per dispatch, +4.2 us per ``fori_loop`` step) against +14.6 / +5.9 us for jax-triton's
``triton_call`` and +46.9 / +6.0 us for a callback XLA cannot record.

Command buffers: the op is ``command_buffer_compatible``, so where XLA records it into a CUDA
graph the Python callback runs once per set of buffer addresses (XLA records again whenever the
addresses change) and the graph replays the recorded launch. That is sound here because every
launch is a pure function of its buffers: the pointers are the arguments, and the table's
contents are read on the device when the graph runs. The table never moves (the core owns it
for the state's lifetime), and commits write it in place on the same stream, so a replayed
graph reads whatever was committed before it. ``tests/test_gpu_jax_kernel_replay.py`` checks
both: new input addresses on every call, and the table written between calls.

Finding the table: on a GPU the callback looks up the core table that owns the table buffer
XLA passed (its address; a state registers its tables here and removes them at close). The
kernel then reads that table's memory, which is that same buffer. A table buffer no open
state owns is refused (the error surfaces when the program's result is read).

On the CPU the callback runs the core's numpy replay (:func:`trace_replay_core.replay_reference`)
on XLA's host buffers, the CPU tables being copies taken at each apply. It refuses what the GPU
refuses: each copy a state hands out is registered here by its address (XLA passes a jitted
function's argument to the callback as it is), so a table buffer no open state handed out (one
built by hand, or one of a closed state, whose tables are deleted at close) is refused the same way.
A copy stays registered until its state closes, since a program queued before an apply may
run after it (the latest ``_CPU_COPIES`` addresses per state: an allocator reuses freed ones).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import jax
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from trace_replay_core import BoundCache, replay_reference

__all__ = ["register_table", "register_copies", "unregister_table", "kernel_replay"]

_BOUND_CACHE_SIZE = 64
_KDL_CPU = 1
_CPU = -1  # the device of a CPU copy's key
_CPU_COPIES = 1024

# (CUDA ordinal or _CPU, table address) -> the core TraceTable that owns that memory (on the
# CPU: whose copy a state handed out).
_TABLES: dict[tuple[int, int], weakref.ReferenceType[Any]] = {}
_TABLES_LOCK = threading.Lock()


def register_table(table: Any) -> None:
    """Let kernel replays find ``table`` (a GPU :class:`~trace_replay_core.TraceTable`) by the
    address of its table memory. Host-only."""
    view, _ = table.device_views()
    with _TABLES_LOCK:
        _TABLES[(view.device_id, view.ptr)] = weakref.ref(table)


def register_copies(table: Any, array: jax.Array) -> None:
    """Let CPU kernel replays accept ``array``, a copy of the CPU ``table``'s trace table that a
    state hands out, by its address, until :func:`unregister_table`. Host-only."""
    key = (_CPU, array.unsafe_buffer_pointer())
    with _TABLES_LOCK:
        _TABLES.pop(key, None)  # a reused address moves to the end: the newest
        _TABLES[key] = weakref.ref(table)
        mine = [k for k, ref in _TABLES.items() if k[0] == _CPU and ref() is table]
        for k in mine[: max(0, len(mine) - _CPU_COPIES)]:
            del _TABLES[k]


def unregister_table(table: Any) -> None:
    with _TABLES_LOCK:
        for key, ref in list(_TABLES.items()):
            if ref() is table or ref() is None:
                del _TABLES[key]


def _owner(device_id: int, ptr: int) -> Any:
    ref = _TABLES.get((device_id, ptr))
    table = ref() if ref is not None else None
    if table is None or table.closed:
        where = "the CPU" if device_id == _CPU else f"cuda:{device_id}"
        raise RuntimeError(
            f"replay(method='kernel') got a table at 0x{ptr:x} on {where} that no open "
            f"TraceReplayState owns: pass state.tables of an open state into the jitted function "
            f"(or use method='jnp', which reads any ReplayTables)"
        )
    return table


def _cpu_replay(out, table, trace_len, sampled, idx, first, second) -> None:
    """Host buffers: the core's numpy replay, written into XLA's output buffer, for a table
    that an open state handed out (as on a GPU)."""
    table = np.asarray(table)
    _owner(_CPU, table.ctypes.data)
    res = np.asarray(out)
    if second is None:
        got = replay_reference(res, np.asarray(idx), np.asarray(table), np.asarray(trace_len), step=np.asarray(first))
    else:
        got = replay_reference(
            res,
            np.asarray(idx),
            np.asarray(table),
            np.asarray(trace_len),
            total_len=np.asarray(first),
            prompt_len=np.asarray(second),
        )
    res[...] = got


def _address(buffer) -> int:
    return buffer.__cuda_array_interface__["data"][0]


class _ReplayCallback:
    """The buffer callback of one signature (shapes, dtypes, step source). On a GPU, one bound
    replay per set of buffer addresses (validated once over DLPack, then only launched); a bound
    entry holds addresses and its core table, never XLA's buffers."""

    def __init__(self, per_row: bool):
        self._per_row = per_row
        self._bound = BoundCache(_BOUND_CACHE_SIZE)

    def __call__(self, ctx, out, table, trace_len, sampled, idx, first, *rest) -> None:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        second = rest[0] if rest else None
        if out.__dlpack_device__()[0] == _KDL_CPU:
            _cpu_replay(out, table, trace_len, sampled, idx, first, second)
            return
        stream = int(ctx.stream)
        device_id = int(out.__dlpack_device__()[1])
        core = _owner(device_id, _address(table))
        key = (id(core), _address(out), _address(idx), _address(first), 0 if second is None else _address(second))
        if self._per_row:
            bound = self._bound.bind(key, lambda: core.bind_replay(out, idx, step=first, stream=stream))
        else:
            bound = self._bound.bind(key, lambda: core.bind_replay(out, idx, first, second, stream=stream))
        bound(stream=stream)


@functools.cache
def _op(out_shape: tuple[int, ...], out_dtype: str, per_row: bool):
    # Flattened inputs: table, trace_len, sampled, idx, first[, second]; sampled (index 2) is
    # aliased to the one output, which the kernel then overwrites row by row.
    return buffer_callback(
        _ReplayCallback(per_row),
        jax.ShapeDtypeStruct(out_shape, np.dtype(out_dtype)),
        input_output_aliases={2: 0},
        command_buffer_compatible=True,
    )


def kernel_replay(table, trace_len, sampled, idx_mapping, first, second):
    """Traced arrays in, the replayed copy of ``sampled`` out (``second is None``: per-row step)."""
    if sampled.shape[0] == 0:
        return sampled
    op = _op(tuple(sampled.shape), np.dtype(sampled.dtype).name, second is None)
    if second is None:
        return op(table, trace_len, sampled, idx_mapping, first)
    return op(table, trace_len, sampled, idx_mapping, first, second)
