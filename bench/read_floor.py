"""The floor under the logprob op: what does merely reading the logits once cost at its shapes?

Question: at vocabulary 151,936 (bfloat16, batch 1 to 4096), how fast can the simplest kernels
that read every logit once go on this GPU, with the logprob op's grid and with others? It tells
whether a target such as 3.6 TB/s at batch 256 (issue 16) is reachable by any kernel of a given
grid shape, and how much of ``token_logprob_rank``'s time is the read itself.

Providers (each reads ``batch x 151,936`` logits and writes one float per program or row):
- ``sum_grid``: a Triton kernel on the op's grid (one program per row and chunk of
  ``CHUNK_BLOCKS`` blocks of 2,048 logits, 4 warps, two blocks unrolled), summing its chunk in
  float32: the op's grid with no other work. Its loads are masked per logit, so ptxas issues
  them a logit at a time (sm_90, Triton 3.6), not as the op's 16-byte vectors.
  ``sum_grid_c<blocks>_w<warps>[_ef][_token]``: the same with other chunks and warps (``_ef``:
  loads marked evict-first; ``_token``: as ``sum_grid_token``), as ``GRID_SHAPES`` lists; 75
  blocks is one program per row.
- ``sum_grid_token``: the same, but each program first loads the row's token id and then the
  token's logit (the two dependent loads every program of the op starts with) and adds it.
- ``sum_persistent``: the same chunks as work items of a persistent grid (``PERSISTENT``
  programs per SM, each taking items ``pid, pid + grid, ...``): no wave tail of short programs.
- ``sum_tma_c<blocks>_w<warps>_s<stages>[_token]``: the op's grid again, but each block read by
  the Tensor Memory Accelerator into shared memory (a host tensor descriptor of the logits,
  ``desc.load``), the loop software-pipelined ``stages`` deep by Triton (``tl.range(...,
  num_stages=)``): a program keeps up to ``stages`` whole blocks in flight without holding them in
  registers, and reaches its token while they arrive. Does another way of loading move the floor
  of the op's grid?
- ``torch_amax``: ``logits.amax(-1)`` (torch's own row reduction).
- ``trace_replay``: ``trace_replay_torch.token_logprob_rank`` (the op itself, plain call).

Timing: ``harness.time_cuda_queued`` (20 calls queued behind a busy kernel, inputs rotated over
up to 32 copies, 256 MiB in all), p20/p50/p80 in us; GB/s of logits read; the device-to-device
copy ceiling of the same run beside it. No provider's result is compared with another's: the sums
only keep the reads from being optimised away.

Run: ``python bench/read_floor.py [word ...]`` on a GPU (only the providers whose names contain
one of the words, when given); writes ``bench/results/read_floor.json``.
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bandwidth, copy_bandwidth, rotating, table, time_cuda_queued, write_results  # noqa: E402

VOCAB = 151_936
BATCHES = (1, 64, 256, 1024, 4096)
BLOCK = 2048
CHUNK_BLOCKS = 6
# Other grid shapes of sum_grid: (blocks per chunk, warps, evict-first loads, the token's loads first).
GRID_SHAPES = (
    (3, 4, False, False),
    (12, 4, False, False),
    (38, 4, False, False),
    (75, 4, False, False),
    (6, 8, False, False),
    (6, 8, False, True),
    (12, 8, False, False),
    (12, 8, False, True),
    (3, 8, False, False),
    (6, 16, False, False),
    (6, 4, True, False),
)
# Blocks read by the Tensor Memory Accelerator (blocks per chunk, warps, pipeline stages, the token's
# loads first). Plain loads in such a loop are not pipelined (Triton pipelines the descriptor loads
# of a loop whose consumer is not a dot, not pointer loads: TTGIR of Triton 3.9, sm_90).
TMA_FORMS = (
    (6, 4, 2, False),
    (6, 4, 3, False),
    (6, 4, 4, False),
    (6, 8, 3, False),
    (6, 4, 3, True),
    (6, 4, 4, True),
    (6, 8, 3, True),
    (12, 4, 3, False),
    (3, 4, 3, False),
)
PERSISTENT = (8, 12)  # programs per SM of the persistent provider
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32


@triton.jit
def _chunk_sum(row_ptr, start, end, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """float32 sum of the logits ``[start, end)`` of one row, a block at a time (masked)."""
    acc = tl.zeros([BLOCK], tl.float32)
    cols = tl.arange(0, BLOCK)
    for off in tl.range(start, end, BLOCK, loop_unroll_factor=2):
        if EVICT_FIRST:
            y = tl.load(row_ptr + off + cols, mask=off + cols < end, other=0.0, eviction_policy="evict_first")
        else:
            y = tl.load(row_ptr + off + cols, mask=off + cols < end, other=0.0)
        acc += y.to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def sum_grid_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    vocab,
    stride,
    n_chunks,
    SPAN: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKEN: tl.constexpr,
    EVICT_FIRST: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = tl.multiple_of(x_ptr + row * stride, 16)
    start = chunk * SPAN
    total = _chunk_sum(row_ptr, start, tl.minimum(start + SPAN, vocab), BLOCK, EVICT_FIRST)
    if TOKEN:  # the op's start: the id, then the logit it names
        total += tl.load(row_ptr + tl.load(ids_ptr + row)).to(tl.float32)
    tl.store(out_ptr + row * n_chunks + chunk, total)


@triton.jit
def sum_tma_kernel(
    desc,
    x_ptr,
    ids_ptr,
    out_ptr,
    vocab,
    stride,
    n_chunks,
    SPAN: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    TOKEN: tl.constexpr,
):
    """``sum_grid_kernel`` with each block read by the TMA into shared memory: ``desc`` views the
    logits as lines of 128 (a box dimension is at most 256), ``[batch, vocab // 128, 128]``;
    lines past the row's end read as zeros."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * SPAN
    acc = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(start, tl.minimum(start + SPAN, vocab), BLOCK, num_stages=STAGES):
        acc += desc.load([row, off // 128, 0]).reshape([BLOCK]).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if TOKEN:
        row_ptr = x_ptr + row.to(tl.int64) * stride
        total += tl.load(row_ptr + tl.load(ids_ptr + row)).to(tl.float32)
    tl.store(out_ptr + row * n_chunks + chunk, total)


@triton.jit
def sum_persistent_kernel(x_ptr, out_ptr, vocab, stride, n_chunks, n_items, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        row = (item // n_chunks).to(tl.int64)
        chunk = item % n_chunks
        row_ptr = tl.multiple_of(x_ptr + row * stride, 16)
        start = chunk * SPAN
        tl.store(out_ptr + item, _chunk_sum(row_ptr, start, tl.minimum(start + SPAN, vocab), BLOCK))


def make_providers(batch, copies, ids, parts, lp, rk, n_sms, token_logprob_rank):
    """``{name: fn(x)}`` for one batch: the read kernels in their forms, torch's amax and the op
    (each function binds this batch's arrays as arguments of this call)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    span = CHUNK_BLOCKS * BLOCK
    n_chunks = triton.cdiv(VOCAB, span)
    providers = {
        "sum_grid": lambda x: sum_grid_kernel[(batch, n_chunks)](
            x, ids, parts, VOCAB, VOCAB, n_chunks, span, BLOCK, False, num_warps=4
        ),
        "sum_grid_token": lambda x: sum_grid_kernel[(batch, n_chunks)](
            x, ids, parts, VOCAB, VOCAB, n_chunks, span, BLOCK, True, num_warps=4
        ),
        "torch_amax": lambda x: x.amax(-1),
        "trace_replay": lambda x: token_logprob_rank(x, ids, out=(lp, rk)),
    }
    for blocks, warps, evict, token in GRID_SHAPES:
        chunks = triton.cdiv(VOCAB, blocks * BLOCK)
        providers[f"sum_grid_c{blocks}_w{warps}{'_ef' if evict else ''}{'_token' if token else ''}"] = (
            lambda x, chunks=chunks, blocks=blocks, warps=warps, evict=evict, token=token: sum_grid_kernel[
                (batch, chunks)
            ](x, ids, parts, VOCAB, VOCAB, chunks, blocks * BLOCK, BLOCK, token, evict, num_warps=warps)
        )
    descs = {
        x.data_ptr(): TensorDescriptor.from_tensor(x.view(batch, VOCAB // 128, 128), [1, BLOCK // 128, 128])
        for x in copies
    }
    for blocks, warps, stages, token in TMA_FORMS:
        chunks = triton.cdiv(VOCAB, blocks * BLOCK)
        providers[f"sum_tma_c{blocks}_w{warps}_s{stages}{'_token' if token else ''}"] = (
            lambda x, chunks=chunks, blocks=blocks, warps=warps, stages=stages, token=token: sum_tma_kernel[
                (batch, chunks)
            ](
                descs[x.data_ptr()],
                x,
                ids,
                parts,
                VOCAB,
                VOCAB,
                chunks,
                blocks * BLOCK,
                BLOCK,
                stages,
                token,
                num_warps=warps,
            )
        )
    for per_sm in PERSISTENT:
        grid = min(batch * n_chunks, per_sm * n_sms)
        providers[f"sum_persistent_{per_sm}"] = lambda x, grid=grid: sum_persistent_kernel[(grid,)](
            x, parts, VOCAB, VOCAB, n_chunks, batch * n_chunks, span, BLOCK, num_warps=4
        )
    return providers


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/read_floor.py needs a CUDA GPU")
    from trace_replay_torch import token_logprob_rank

    only = sys.argv[1:]  # provider names that contain any of these words (default: all)
    dev = torch.device("cuda", 0)
    n_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()["d2d"]["gbps_p50"]
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rows = []
    for batch in BATCHES:
        base = (torch.randn(batch, VOCAB, device=dev) * 4).bfloat16()
        nbytes = base.numel() * base.element_size()
        copies = [base] + [base.clone() for _ in range(min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes))) - 1)]
        ids = torch.randint(0, VOCAB, (batch,), device=dev)
        parts = torch.empty(batch * triton.cdiv(VOCAB, 3 * BLOCK), device=dev)  # room for the finest grid
        lp = torch.empty(batch, device=dev)
        rk = torch.empty(batch, dtype=torch.int64, device=dev)
        providers = make_providers(batch, copies, ids, parts, lp, rk, n_sms, token_logprob_rank)
        for name, fn in providers.items():
            if only and not any(word in name for word in only):
                continue
            stats = time_cuda_queued(rotating([lambda x=x, fn=fn: fn(x) for x in copies]))
            row = dict(
                provider=name,
                dtype="bfloat16",
                batch=batch,
                vocab=VOCAB,
                bytes=nbytes,
                copy_gbps=copy_gbps,
                timing="cuda events, queued behind a busy kernel",
                **stats,
                **bandwidth(nbytes, stats),
            )
            row["share_of_copy"] = row["gbps_p50"] / copy_gbps
            rows.append(row)
            print(
                f"B={batch:5d} {name:18s} p50 {stats['us_p50']:8.2f} us [{stats['us_p20']:.2f}, "
                f"{stats['us_p80']:.2f}] {row['gbps_p50']:6.0f} GB/s ({row['share_of_copy']:.0%} of copy)"
                f"{'' if stats.get('host_hidden', True) else ' (host not hidden)'}",
                flush=True,
            )
        del base, copies, providers
        torch.cuda.empty_cache()
    path = write_results("read_floor", rows)
    print(f"\nwrote {path}\n")
    print(table(rows, ["provider", "batch", "us_p20", "us_p50", "us_p80", "gbps_p50", "share_of_copy"]))


if __name__ == "__main__":
    main()
