"""The replay kernel: overwrite ``sampled[b]`` with the trace token of its slot's current step.

Per batch row ``b``: ``slot = idx_mapping[b]``; the row is left alone when ``slot`` is outside
``[0, max_slots)``, when the slot has no trace (``trace_len[slot] <= 0``) or when the step is
outside ``[0, trace_len[slot])``. The step is ``total_len[slot] - prompt_len[slot]`` (the
number of outputs already committed for that request), or ``step[b]`` in per-row mode.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["replay_kernel", "REPLAY_BLOCK", "REPLAY_NUM_WARPS"]

# One program handles REPLAY_BLOCK rows: the kernel is a handful of dependent gathers per row,
# so few, wide programs keep the launch the only cost up to batch ~1024.
REPLAY_BLOCK = 256
REPLAY_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["n_rows", "max_slots", "row_stride"],
    do_not_specialize_on_alignment=["sampled_ptr", "idx_ptr", "total_ptr", "prompt_ptr",
                                    "table_ptr", "trace_len_ptr"],
)
def replay_kernel(
    sampled_ptr,        # [n_rows] int32/int64, written in place
    idx_ptr,            # [n_rows] int32/int64 slot per row, -1 = no request
    total_ptr,          # [>= max_slots] per-slot total length, or [n_rows] step when PER_ROW_STEP
    prompt_ptr,         # [>= max_slots] per-slot prompt length (unused when PER_ROW_STEP)
    table_ptr,          # [max_slots, row_stride] int32 trace tokens
    trace_len_ptr,      # [max_slots] int32 trace length per slot, 0 = untraced
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
        step = tl.load(total_ptr + rows, mask=active, other=-1).to(tl.int64)
    else:
        total = tl.load(total_ptr + slot, mask=active, other=0).to(tl.int64)
        prompt = tl.load(prompt_ptr + slot, mask=active, other=0).to(tl.int64)
        step = total - prompt
    active = active & (n > 0) & (step >= 0) & (step < n)
    token = tl.load(table_ptr + slot * row_stride + step, mask=active, other=0)
    tl.store(sampled_ptr + rows, token.to(sampled_ptr.dtype.element_ty), mask=active)
