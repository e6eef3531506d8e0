"""A test double of the GPU backend that runs the real Triton kernels in Triton's interpreter.

It packs each commit exactly as the GPU backend does (tokens back to back, 4-token aligned, then
one (slot, length, offset) int64 triple per entry), scatters with the interpreted scatter kernel
and replays with the interpreted replay kernel, on torch CPU tensors.
"""

import numpy as np
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from trace_replay_core.kernels.replay import REPLAY_BLOCK, replay_kernel
from trace_replay_core.kernels.scatter import SCATTER_BLOCK, scatter_kernel
from trace_replay_core.validate import check_slot, check_trace

_SCATTER = InterpretedFunction(scatter_kernel.fn)
_REPLAY = InterpretedFunction(replay_kernel.fn)


class InterpretedTable:
    def __init__(self, max_slots, max_len, vocab_size=None):
        self.max_slots, self.max_len, self.vocab_size = max_slots, max_len, vocab_size
        self.table = torch.full((max_slots, max_len), -99, dtype=torch.int32)
        self.trace_len = torch.zeros(max_slots, dtype=torch.int32)
        self._entries = {}

    def close(self):
        pass

    @property
    def pending(self):
        return len(self._entries)

    def stage(self, slot, tokens):
        slot = check_slot(slot, self.max_slots)
        arr = check_trace(tokens, max_trace_len=self.max_len, vocab_size=self.vocab_size)
        self._entries[slot] = arr.astype(np.int32)

    def clear(self, slot):
        self._entries[check_slot(slot, self.max_slots)] = None

    def commit(self, *, stream):
        if not self._entries:
            return
        chunks, meta, off = [], [], 0
        for slot, arr in self._entries.items():
            n = 0 if arr is None else len(arr)
            meta.append((slot, n, off))
            if n:
                chunks.append(arr)
                chunks.append(np.full(-n % 4, -1, np.int32))
                off += n + (-n % 4)
        tokens = torch.from_numpy(np.concatenate(chunks + [np.zeros(1, np.int32)]))
        meta_t = torch.from_numpy(np.asarray(meta, np.int64).reshape(-1))
        longest = max(m[1] for m in meta)
        chunks_n = max(1, min(triton.cdiv(longest, SCATTER_BLOCK), 64))
        _SCATTER[(len(meta), chunks_n)](meta_t, tokens, self.table, self.trace_len, self.max_len, chunks_n,
                                        BLOCK=SCATTER_BLOCK)
        self._entries = {}

    def _replay(self, sampled, idx, first, second, per_row):
        rows = sampled.shape[0]
        if rows == 0:
            return
        s = torch.from_numpy(sampled)
        _REPLAY[(triton.cdiv(rows, REPLAY_BLOCK),)](
            s, torch.from_numpy(idx), torch.from_numpy(first), torch.from_numpy(second), self.table,
            self.trace_len, rows, self.max_slots, self.max_len, PER_ROW_STEP=per_row, BLOCK=REPLAY_BLOCK)

    def replay(self, sampled, idx, total, prompt, *, stream):
        self._replay(sampled, idx, total, prompt, False)

    def replay_at_step(self, sampled, idx, step, *, stream):
        self._replay(sampled, idx, step, step, True)
