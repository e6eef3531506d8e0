"""The commit kernel: scatter staged traces from the device staging buffer into the table.

The staging buffer holds the tokens of every staged trace back to back (int32), followed by
one int64 triple per entry: ``(slot, length, offset)``. Entry ``e`` copies
``tokens[offset : offset + length]`` to ``table[slot, :length]`` and sets
``trace_len[slot] = length`` (``length == 0`` clears the slot). Slots are unique per commit,
so programs never race.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["scatter_kernel", "SCATTER_BLOCK", "SCATTER_NUM_WARPS", "SCATTER_MAX_CHUNK_PROGRAMS"]

SCATTER_BLOCK = 1024          # int32 tokens per program per iteration (4 KiB)
SCATTER_NUM_WARPS = 4
SCATTER_MAX_CHUNK_PROGRAMS = 64  # programs per entry; longer traces loop


@triton.jit(
    do_not_specialize=["row_stride", "chunk_programs"],
    do_not_specialize_on_alignment=["meta_ptr", "tokens_ptr", "table_ptr", "trace_len_ptr"],
)
def scatter_kernel(
    meta_ptr,           # [n_entries, 3] int64: slot, length, offset (in tokens)
    tokens_ptr,         # int32 staged tokens
    table_ptr,          # [max_slots, row_stride] int32
    trace_len_ptr,      # [max_slots] int32
    row_stride,
    chunk_programs,     # grid size along axis 1
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
