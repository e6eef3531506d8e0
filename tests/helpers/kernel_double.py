"""A test double of the GPU backend that runs the real Triton kernels in Triton's interpreter.

It stages and packs each commit with the library's own staging layout
(``trace_replay_core._staging.StagedEntries``: tokens back to back, 4-token aligned, then one
(slot, length, offset) int64 triple per entry) in a plain numpy buffer, scatters with the
interpreted scatter kernel and replays with the interpreted replay kernel, on torch CPU tensors.
"""

import numpy as np
import torch
from triton.runtime.interpreter import InterpretedFunction

from trace_replay_core._staging import StagedEntries
from trace_replay_core._validate import check_slot, trace_array
from trace_replay_core.kernels.replay import REPLAY_BLOCK, plan_replay, replay_kernel
from trace_replay_core.kernels.scatter import SCATTER_BLOCK, plan_scatter, scatter_kernel

_SCATTER = InterpretedFunction(scatter_kernel.fn)
_REPLAY = InterpretedFunction(replay_kernel.fn)


class InterpretedTable:
    def __init__(self, max_slots, max_len, vocab_size=None):
        self.max_slots, self.max_len, self.vocab_size = max_slots, max_len, vocab_size
        self.table = torch.full((max_slots, max_len), -99, dtype=torch.int32)
        self.trace_len = torch.zeros(max_slots, dtype=torch.int32)
        self._buffer = np.zeros(16, np.uint32)
        self._staged = StagedEntries(self._buffer, self._reserve)

    def _reserve(self, tokens_needed, new_entries):
        need = self._staged.bytes_needed(tokens_needed, new_entries)
        if need > self._buffer.nbytes:
            grown = np.zeros(max(need, 2 * self._buffer.nbytes) // 4 + 1, np.uint32)
            grown[: self._staged.fill] = self._buffer[: self._staged.fill]
            self._buffer = self._staged.tokens = grown

    def close(self):
        pass

    @property
    def pending(self):
        return len(self._staged.entries)

    def stage(self, slot, tokens):
        slot = check_slot(slot, self.max_slots)
        self._staged.stage(slot, trace_array(tokens, max_trace_len=self.max_len), self.vocab_size)

    def clear(self, slot):
        self._staged.clear(check_slot(slot, self.max_slots))

    def commit(self, *, stream):
        if not self._staged.entries:
            return
        n, meta_off, nbytes = self._staged.pack()
        packed = self._buffer.view(np.uint8)[:nbytes]
        tokens = torch.from_numpy(packed[:meta_off].view(np.int32).copy() if meta_off else np.zeros(1, np.int32))
        meta_t = torch.from_numpy(packed[meta_off:].view(np.int64).copy())
        grid = plan_scatter(n, self._staged.longest)
        _SCATTER[grid[:2]](meta_t, tokens, self.table, self.trace_len, self.max_len, grid[1], BLOCK=SCATTER_BLOCK)
        self._staged.reset()

    def _replay(self, sampled, idx, total, prompt, step):
        rows = sampled.shape[0]
        if rows == 0:
            return
        s = torch.from_numpy(sampled)
        unused = torch.from_numpy(idx)  # the interpreter needs a tensor for every pointer
        as_t = lambda a: unused if a is None else torch.from_numpy(a)  # noqa: E731
        _REPLAY[plan_replay(rows)[:1]](
            s,
            torch.from_numpy(idx),
            as_t(total),
            as_t(prompt),
            as_t(step),
            self.table,
            self.trace_len,
            rows,
            self.max_slots,
            self.max_len,
            PER_ROW_STEP=step is not None,
            BLOCK=REPLAY_BLOCK,
        )

    def replay(self, sampled, idx, total, prompt, *, stream):
        self._replay(sampled, idx, total, prompt, None)

    def replay_at_step(self, sampled, idx, step, *, stream):
        self._replay(sampled, idx, None, None, step)
