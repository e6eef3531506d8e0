"""CPU tier: the Triton kernels themselves, run by Triton's interpreter, against the reference.

``TRITON_INTERPRET=1`` makes ``@triton.jit`` build an ``InterpretedFunction``; here the same
interpreter is built explicitly from each kernel's Python function, so that this module neither
depends on nor changes the process environment. The interpreter takes torch CPU tensors.
"""

import numpy as np
import pytest
import torch
import triton
from helpers import POISON, assert_tokens_equal, random_scenario  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from trace_replay_core import replay_reference  # noqa: E402
from trace_replay_core.kernels.replay import REPLAY_BLOCK, replay_kernel  # noqa: E402
from trace_replay_core.kernels.scatter import SCATTER_BLOCK, scatter_kernel  # noqa: E402

INT_DTYPES = [np.int32, np.int64]


def interpreted(kernel):
    return InterpretedFunction(kernel.fn)


@pytest.mark.parametrize("batch", [1, 5, 100, 1024])
@pytest.mark.parametrize("sampled_dtype", INT_DTYPES)
@pytest.mark.parametrize("index_dtype", INT_DTYPES)
@pytest.mark.parametrize("per_row_step", [False, True])
def test_replay_kernel_matches_reference(rng, batch, sampled_dtype, index_dtype, per_row_step):
    max_slots, max_trace_len = 41, 23
    sc = random_scenario(
        rng,
        max_slots=max_slots,
        max_trace_len=max_trace_len,
        batch=batch,
        sampled_dtype=sampled_dtype,
        index_dtype=index_dtype,
    )
    table = np.where(sc["table"] < 0, 0, sc["table"]).astype(np.int32)
    sampled = torch.from_numpy(sc["sampled"].copy())
    t = {k: torch.from_numpy(np.ascontiguousarray(sc[k])) for k in ("idx", "total_len", "prompt_len", "step")}
    if per_row_step:  # the interpreter needs a tensor for every pointer, read or not
        total, prompt, step = t["step"], t["step"], t["step"]
        expected = replay_reference(sc["sampled"], sc["idx"], table, sc["trace_len"], step=sc["step"])
    else:
        total, prompt, step = t["total_len"], t["prompt_len"], t["total_len"]
        expected = replay_reference(sc["sampled"], sc["idx"], table, sc["trace_len"], sc["total_len"], sc["prompt_len"])
    grid = (triton.cdiv(batch, REPLAY_BLOCK),)
    interpreted(replay_kernel)[grid](
        sampled,
        t["idx"],
        total,
        prompt,
        step,
        torch.from_numpy(table),
        torch.from_numpy(sc["trace_len"]),
        batch,
        max_slots,
        max_trace_len,
        PER_ROW_STEP=per_row_step,
        BLOCK=REPLAY_BLOCK,
    )
    assert sampled.dtype == torch.from_numpy(sc["sampled"]).dtype
    assert_tokens_equal(sampled.numpy(), expected)


@pytest.mark.parametrize("n_entries", [1, 3, 17])
def test_scatter_kernel_writes_rows_and_lengths(rng, n_entries):
    max_slots, row = 20, 3000  # rows longer than one block and than the chunk grid
    slots = rng.choice(max_slots, size=n_entries, replace=False)
    lengths = [int(rng.integers(0, row + 1)) for _ in slots]  # 0 = clear
    tokens, meta, off = [], [], 0
    for slot, n in zip(slots, lengths):
        tr = rng.integers(0, 2**31 - 1, n).astype(np.int32)
        tokens.append(tr)
        meta.append((slot, n, off))
        off += n + (-n % 4)
        tokens.append(np.full(-n % 4, POISON, np.int32))
    staged = torch.from_numpy(np.concatenate(tokens + [np.zeros(1, np.int32)]))
    meta_t = torch.from_numpy(np.asarray(meta, dtype=np.int64).reshape(-1))
    table = torch.full((max_slots, row), POISON, dtype=torch.int32)
    trace_len = torch.full((max_slots,), 99, dtype=torch.int32)
    chunks = 2
    interpreted(scatter_kernel)[(n_entries, chunks)](meta_t, staged, table, trace_len, row, chunks, BLOCK=SCATTER_BLOCK)
    for slot, n, o in meta:
        assert trace_len[slot].item() == n
        assert_tokens_equal(table[slot, :n].numpy(), staged[o : o + n].numpy(), f"slot {slot}")
        assert (table[slot, n:] == POISON).all(), f"slot {slot}: wrote past the trace"
    untouched = sorted(set(range(max_slots)) - set(int(s) for s in slots))
    assert (trace_len[untouched] == 99).all() and (table[untouched] == POISON).all()
