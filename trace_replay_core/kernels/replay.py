"""Replay: overwrite ``sampled[b]`` with the trace token of its slot's current step.

Per batch row ``b``: ``slot = idx_mapping[b]``; the row is left alone when ``slot`` is outside
``[0, max_slots)``, when the slot has no trace (``trace_len[slot] <= 0``) or when the step is
outside ``[0, trace_len[slot])``. The step comes from one of two sources, the one convention
used everywhere in the library (kernel, numpy twin, reference, public methods):

- per slot: ``step = total_len[slot] - prompt_len[slot]`` (outputs already committed), read
  on the device (``step`` absent);
- per row: ``step[b]`` (``total_len`` and ``prompt_len`` absent).

This module holds the kernel, its plan (:func:`plan_replay`) and its launch on integers
(:func:`bind_replay`, :func:`launch_replay`): pointers are byte addresses, sizes plain ints,
the stream a raw ``CUstream`` handle.
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from ._compiled import CompiledKernel, compiled

__all__ = [
    "replay_kernel",
    "plan_replay",
    "replay_compiled",
    "bind_replay",
    "launch_replay",
    "REPLAY_BLOCK",
    "REPLAY_NUM_WARPS",
]

# One program handles REPLAY_BLOCK rows: the kernel is a handful of dependent gathers per row,
# so few, wide programs keep the launch the only cost up to batch ~1024.
REPLAY_BLOCK = 256
REPLAY_NUM_WARPS = 4
_UNUSED_DTYPE = "int32"  # the dtype an absent step source is compiled with (its pointer is 0)


@triton.jit(
    do_not_specialize=["n_rows", "max_slots", "row_stride"],
    do_not_specialize_on_alignment=[
        "sampled_ptr",
        "idx_ptr",
        "total_ptr",
        "prompt_ptr",
        "step_ptr",
        "table_ptr",
        "trace_len_ptr",
    ],
)
def replay_kernel(
    sampled_ptr,  # [n_rows] int32/int64, written in place
    idx_ptr,  # [n_rows] int32/int64 slot per row, -1 = no request
    total_ptr,  # [>= max_slots] per-slot total length (read unless PER_ROW_STEP)
    prompt_ptr,  # [>= max_slots] per-slot prompt length (read unless PER_ROW_STEP)
    step_ptr,  # [n_rows] per-row step (read when PER_ROW_STEP)
    table_ptr,  # [max_slots, row_stride] int32 trace tokens
    trace_len_ptr,  # [max_slots] int32 trace length per slot, 0 = untraced
    n_rows,
    max_slots,
    row_stride,
    PER_ROW_STEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = rows < n_rows
    slot = tl.load(idx_ptr + rows, mask=in_batch, other=-1).to(tl.int64)
    active = in_batch & (slot >= 0) & (slot < max_slots)
    n = tl.load(trace_len_ptr + slot, mask=active, other=0).to(tl.int64)
    if PER_ROW_STEP:
        step = tl.load(step_ptr + rows, mask=active, other=-1).to(tl.int64)
    else:
        total = tl.load(total_ptr + slot, mask=active, other=0).to(tl.int64)
        prompt = tl.load(prompt_ptr + slot, mask=active, other=0).to(tl.int64)
        step = total - prompt
    active = active & (n > 0) & (step >= 0) & (step < n)
    token = tl.load(table_ptr + slot * row_stride + step, mask=active, other=0)
    tl.store(sampled_ptr + rows, token.to(sampled_ptr.dtype.element_ty), mask=active)


def plan_replay(rows: int) -> tuple[int, int, int]:
    """The grid of a replay over ``rows`` batch rows (``rows >= 1``). Pure."""
    return ((rows + REPLAY_BLOCK - 1) // REPLAY_BLOCK, 1, 1)


def replay_compiled(
    device_id: int, sampled_dtype: str, idx_dtype: str, length_dtypes: tuple[str, str], step_dtype: str | None
) -> CompiledKernel:
    """The compiled replay kernel for these dtypes on ``device_id``: per-slot when ``step_dtype``
    is None (``length_dtypes`` = dtypes of total_len, prompt_len), else per-row (``length_dtypes``
    ignored). Compiles on first use (host-blocking, and not allowed while a CUDA graph is being
    captured: the first replay or bind for a device and dtypes must come before capturing), then
    a cache hit."""
    per_row = step_dtype is not None
    total_dtype, prompt_dtype = (_UNUSED_DTYPE, _UNUSED_DTYPE) if per_row else length_dtypes
    dtypes = (sampled_dtype, idx_dtype, total_dtype, prompt_dtype, step_dtype or _UNUSED_DTYPE, "int32", "int32")
    return compiled(
        replay_kernel, device_id, dtypes, 3, {"PER_ROW_STEP": per_row, "BLOCK": REPLAY_BLOCK}, REPLAY_NUM_WARPS
    )


def _args(rows, sampled_ptr, idx_ptr, total_ptr, prompt_ptr, step_ptr, table_ptr, trace_len_ptr, max_slots, row_stride):
    return (
        sampled_ptr,
        idx_ptr,
        total_ptr,
        prompt_ptr,
        step_ptr,
        table_ptr,
        trace_len_ptr,
        rows,
        max_slots,
        row_stride,
    )


def bind_replay(
    kernel: CompiledKernel,
    *,
    rows: int,
    sampled_ptr: int,
    idx_ptr: int,
    total_ptr: int,
    prompt_ptr: int,
    step_ptr: int,
    table_ptr: int,
    trace_len_ptr: int,
    max_slots: int,
    row_stride: int,
) -> Callable[[int], None]:
    """``launch(stream)`` queuing ``kernel`` (from :func:`replay_compiled`) with every argument
    fixed: one ``cuLaunchKernel`` per call. Absent step sources pass pointer 0. ``rows >= 1``."""
    return kernel.bind(
        plan_replay(rows),
        *_args(
            rows, sampled_ptr, idx_ptr, total_ptr, prompt_ptr, step_ptr, table_ptr, trace_len_ptr, max_slots, row_stride
        ),
    )


def launch_replay(
    kernel: CompiledKernel,
    stream: int,
    *,
    rows: int,
    sampled_ptr: int,
    idx_ptr: int,
    total_ptr: int,
    prompt_ptr: int,
    step_ptr: int,
    table_ptr: int,
    trace_len_ptr: int,
    max_slots: int,
    row_stride: int,
) -> None:
    """Queue one replay on ``stream`` with an already compiled ``kernel`` (stream-ordered, never
    blocks); arguments as :func:`bind_replay`."""
    kernel.launch(
        plan_replay(rows),
        stream,
        *_args(
            rows, sampled_ptr, idx_ptr, total_ptr, prompt_ptr, step_ptr, table_ptr, trace_len_ptr, max_slots, row_stride
        ),
    )
