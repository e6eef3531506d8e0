"""Commit: scatter staged traces from the device staging buffer into the table.

The staging buffer holds the tokens of every staged trace back to back (int32), followed by
one int64 triple per entry: ``(slot, length, offset)`` (the layout of
:class:`~trace_replay_core._staging.StagedEntries`). Entry ``e`` copies
``tokens[offset : offset + length]`` to ``table[slot, :length]`` and sets
``trace_len[slot] = length`` (``length == 0`` clears the slot). Slots are unique per commit,
so programs never race.

This module holds the kernel, its plan (:func:`plan_scatter`) and its launcher on integers
(:func:`scatter_launcher`).
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from ._compiled import compiled

__all__ = [
    "scatter_kernel",
    "plan_scatter",
    "scatter_launcher",
    "SCATTER_BLOCK",
    "SCATTER_NUM_WARPS",
    "SCATTER_MAX_CHUNK_PROGRAMS",
]

SCATTER_BLOCK = 1024  # int32 tokens per program per iteration (4 KiB)
SCATTER_NUM_WARPS = 4
SCATTER_MAX_CHUNK_PROGRAMS = 64  # programs per entry; longer traces loop


@triton.jit(
    do_not_specialize=["row_stride", "chunk_programs"],
    do_not_specialize_on_alignment=["meta_ptr", "tokens_ptr", "table_ptr", "trace_len_ptr"],
)
def scatter_kernel(
    meta_ptr,  # [n_entries, 3] int64: slot, length, offset (in tokens)
    tokens_ptr,  # int32 staged tokens
    table_ptr,  # [max_slots, row_stride] int32
    trace_len_ptr,  # [max_slots] int32
    row_stride,
    chunk_programs,  # grid size along axis 1
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(meta_ptr + entry * 3)
    length = tl.load(meta_ptr + entry * 3 + 1)
    offset = tl.load(meta_ptr + entry * 3 + 2)
    if chunk == 0:
        tl.store(trace_len_ptr + slot, length.to(tl.int32))
    cols = tl.arange(0, BLOCK)
    for start in range(chunk * BLOCK, length, chunk_programs * BLOCK):
        idx = start + cols
        mask = idx < length
        tok = tl.load(tokens_ptr + offset + idx, mask=mask)
        tl.store(table_ptr + slot * row_stride + idx, tok, mask=mask)


def plan_scatter(entries: int, longest: int) -> tuple[int, int, int]:
    """The grid of a commit of ``entries`` entries whose longest trace has ``longest`` tokens:
    one row of programs per entry, up to :data:`SCATTER_MAX_CHUNK_PROGRAMS` programs along it
    (``grid[1]`` is also the kernel's ``chunk_programs``). Pure."""
    chunks = max(1, min(-(-longest // SCATTER_BLOCK), SCATTER_MAX_CHUNK_PROGRAMS))
    return (entries, chunks, 1)


def scatter_launcher(device_id: int) -> Callable[..., None]:
    """``launch(stream, entries, longest, meta_ptr, tokens_ptr, table_ptr, trace_len_ptr,
    row_stride)`` queuing one scatter on ``stream`` (stream-ordered, never blocks). The launcher
    owns a parameter block that every call rewrites: one per caller that serialises its
    commits (a table, under its lock). Compiles on first use (host-blocking)."""
    kernel = compiled(
        scatter_kernel, device_id, ("int64", "int32", "int32", "int32"), 2, {"BLOCK": SCATTER_BLOCK}, SCATTER_NUM_WARPS
    )
    run = kernel.launcher()

    def launch(
        stream: int,
        entries: int,
        longest: int,
        meta_ptr: int,
        tokens_ptr: int,
        table_ptr: int,
        trace_len_ptr: int,
        row_stride: int,
    ) -> None:
        grid = plan_scatter(entries, longest)
        run(grid, stream, meta_ptr, tokens_ptr, table_ptr, trace_len_ptr, row_stride, grid[1])

    return launch
