"""token_logprob_rank on the GPU (marked ``gpu``, skipped without one): bitwise batch
invariance at vocabulary 151,936 for batches 1 to 1024 in three dtypes (torch adapter, inside a
CUDA graph, and the JAX kernel method equal to torch) and at GPT-2's 50,257 (rows not 16-byte
aligned) for a row alone and in batches, more than 2**31 logits, top-k exact with
special rows, the top-k workspace size enforced. References and checks: ``test_logprob_topk.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.logprob_cases import POISON_LOGPROB, POISON_RANK, TORCH_DTYPES, assert_matches_reference, round_to  # noqa: E402
from helpers.topk_cases import assert_topk, processed, special_rows, tied_case  # noqa: E402

from trace_replay_core import token_logprob_rank  # noqa: E402
from trace_replay_core._logprob import logprob_rank_workspace_bytes  # noqa: E402

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
GPU_VOCAB = 151936
GPU_BATCHES = (1, 7, 64, 255, 256, 257, 300, 1024)  # 1, 2 (300) and 4 (1024) chunks per program


def _gpu_base(dtype: str, rows: int, seed: int):
    """Random logits on the device (exact in dtype), planted ties in a few rows, and ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, GPU_VOCAB, device="cuda", generator=g) * 4).to(TORCH_DTYPES[dtype])
    ids = torch.randint(0, GPU_VOCAB, (rows,), device="cuda", generator=g)
    x[1::5, 100] = x[1::5].float().amax(dim=1).to(x.dtype)  # ties at the top
    r = torch.arange(2, rows, 5, device="cuda")
    x[r, 150000] = x[r, ids[r]]  # ties with the token
    x[3::5, : 3 * 4096] = float("-inf")  # whole blocks of -inf
    return x, ids


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_gpu_batch_invariant_bitwise(dtype):
    """The same rows give the same bits in batches of 1 to 1024, at any position, among other
    rows, through the torch adapter (with and without top-k and temperature) and in a CUDA graph."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    base, ids = _gpu_base(dtype, 1024, 1)
    temp = torch.rand(1024, device="cuda") + 0.5
    full = torch_logprob_rank(base, ids)
    full_k = torch_logprob_rank(base, ids, top_k=20, temperature=temp)
    # The top-k kernels run the same reduction: the same logprob and rank bits as without top-k.
    only_k = torch_logprob_rank(base, ids, top_k=20)
    assert torch.equal(only_k.logprobs.view(torch.int32), full.logprobs.view(torch.int32)), "top-k logprobs"
    assert torch.equal(only_k.ranks, full.ranks), "top-k ranks"
    gen = torch.Generator(device="cpu").manual_seed(2)
    for batch in GPU_BATCHES:
        rows = torch.randperm(1024, generator=gen)[:batch].cuda()
        sub = base[rows].contiguous()
        got = torch_logprob_rank(sub, ids[rows])
        assert torch.equal(got.logprobs.view(torch.int32), full.logprobs[rows].view(torch.int32)), f"batch {batch}"
        assert torch.equal(got.ranks, full.ranks[rows]), f"batch {batch} ranks"
        got_k = torch_logprob_rank(sub, ids[rows], top_k=20, temperature=temp[rows].contiguous())
        for name in ("logprobs", "ranks", "topk_logprobs", "topk_ids"):
            a, b = getattr(got_k, name), getattr(full_k, name)[rows]
            a, b = (a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else (a, b)
            assert torch.equal(a, b), f"batch {batch} {name} (top-k 20, temperature)"
    # Inside a CUDA graph, at batch 257 (the kernels are compiled by the calls above).
    rows = torch.randperm(1024, generator=gen)[:257].cuda()
    sub, sub_ids = base[rows].contiguous(), ids[rows].contiguous()
    out = (torch.empty(257, device="cuda"), torch.empty(257, dtype=torch.int64, device="cuda"))
    torch_logprob_rank(sub, sub_ids, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch_logprob_rank(sub, sub_ids, out=out)
    out[0].fill_(POISON_LOGPROB)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0].view(torch.int32), full.logprobs[rows].view(torch.int32)), "CUDA graph"
    # And a handful of rows against the float64 reference.
    x = base[:16].float().cpu().numpy()
    assert_matches_reference(
        x, ids[:16].cpu().numpy(), full.logprobs[:16].cpu().numpy(), full.ranks[:16].cpu().numpy(), f"gpu {dtype}"
    )
    y = processed(x, temp[:16].cpu().numpy())
    assert_topk(
        y, 20, full_k.topk_logprobs[:16].cpu().numpy(), full_k.topk_ids[:16].cpu().numpy(), f"gpu {dtype} top-k"
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_gpu_jax_kernel_batch_invariant_and_equal_to_torch(dtype):
    import jax
    from helpers.jax_helpers import jax_gpu

    from trace_replay_jax import token_logprob_rank as jax_logprob_rank
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    gpu = jax_gpu()
    base, ids = _gpu_base(dtype, 1024, 3)
    full = torch_logprob_rank(base, ids, top_k=20)
    step = jax.jit(lambda a, b: jax_logprob_rank(a, b, top_k=20))
    gen = torch.Generator(device="cpu").manual_seed(4)
    for batch in GPU_BATCHES:
        rows = torch.randperm(1024, generator=gen)[:batch].cuda()
        sub, sub_ids = base[rows].contiguous(), ids[rows].to(torch.int32).contiguous()
        torch.cuda.synchronize()
        xj, ij = jax.dlpack.from_dlpack(sub), jax.dlpack.from_dlpack(sub_ids)
        assert xj.devices() == {gpu}
        res = jax.block_until_ready(step(xj, ij))
        want = {k: getattr(full, k)[rows].cpu().numpy() for k in full._fields}
        assert np.asarray(res.logprobs).tobytes() == want["logprobs"].tobytes(), f"jax batch {batch}"
        assert np.array_equal(np.asarray(res.ranks), want["ranks"]), f"jax batch {batch} ranks"
        assert np.array_equal(np.asarray(res.topk_ids), want["topk_ids"]), f"jax batch {batch} top-k ids"
        assert np.asarray(res.topk_logprobs).tobytes() == want["topk_logprobs"].tobytes(), f"jax batch {batch}"


ODD_VOCAB = 50257  # GPT-2's: rows of 100,514 bytes in bfloat16 (201,028 in float32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_gpu_odd_vocabulary_rows_alone_same_bits(dtype):
    """Rows whose length is not a multiple of 16 bytes: a contiguous batch's rows are not all
    16-byte aligned while one row alone, freshly allocated, is. The kernels follow the layout of
    contiguous rows of the vocabulary, so the same rows give the same bits alone and in batches,
    with top-k too; a few rows against the float64 reference."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    g = torch.Generator(device="cuda").manual_seed(5)
    base = (torch.randn(257, ODD_VOCAB, device="cuda", generator=g) * 4).to(TORCH_DTYPES[dtype])
    ids = torch.randint(0, ODD_VOCAB, (257,), device="cuda", generator=g)
    full = torch_logprob_rank(base, ids, top_k=20)
    plain = torch_logprob_rank(base, ids)
    assert torch.equal(plain.logprobs.view(torch.int32), full.logprobs.view(torch.int32))
    gen = torch.Generator(device="cpu").manual_seed(6)
    for batch in (1, 1, 2, 7, 64):
        rows = torch.randperm(257, generator=gen)[:batch].cuda()
        sub = base[rows].contiguous()  # one row: a fresh, aligned allocation
        assert batch > 1 or sub.data_ptr() % 16 == 0
        got = torch_logprob_rank(sub, ids[rows], top_k=20)
        for name in ("logprobs", "ranks", "topk_logprobs", "topk_ids"):
            a, b = getattr(got, name), getattr(full, name)[rows]
            a, b = (a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else (a, b)
            assert torch.equal(a, b), f"batch {batch} {name}"
        one = torch_logprob_rank(sub, ids[rows])  # and without top-k
        assert torch.equal(one.logprobs.view(torch.int32), plain.logprobs[rows].view(torch.int32)), f"batch {batch}"
    x = base[:8].float().cpu().numpy()
    assert_matches_reference(
        x,
        ids[:8].cpu().numpy(),
        full.logprobs[:8].cpu().numpy(),
        full.ranks[:8].cpu().numpy(),
        f"gpu {dtype} vocab {ODD_VOCAB}",
    )
    assert_topk(
        x,
        20,
        full.topk_logprobs[:8].cpu().numpy(),
        full.topk_ids[:8].cpu().numpy(),
        f"gpu {dtype} vocab {ODD_VOCAB} top-k",
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("vocab", [GPU_VOCAB, ODD_VOCAB, 32000])
@pytest.mark.parametrize(
    "dtype,with_temp", [("bfloat16", False), ("float32", False), ("float16", False), ("bfloat16", True)]
)
def test_gpu_layouts_same_bits(vocab, dtype, with_temp):
    """The same logits with 16-byte aligned rows and without (GPT-2's contiguous rows, a padded
    stride, an array that starts 1 to 7 elements off a boundary), in every dtype, with and
    without a temperature: unaligned rows read each line's two aligned vectors and shift its
    words into place, so every layout gives the same bits, with top-k and argmax too (at 32,000
    and 50,257 the last block of a row is partial). The memory around the rows holds NaN, which
    no result may read."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    g = torch.Generator(device="cuda").manual_seed(21)
    batch = 64
    tdtype = getattr(torch, dtype)
    x = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).to(tdtype)
    ids = torch.randint(0, vocab, (batch,), device="cuda", generator=g)
    temp = (torch.rand(batch, device="cuda", generator=g) * 1.5 + 0.5) if with_temp else None
    gids = ids.clone()
    gids[1::2] = -1  # greedy rows, scored as their argmax
    per_line = 16 // x.element_size()
    aligned = -(-vocab // per_line) * per_line

    def laid_out(stride, skew):
        """``x`` in rows of ``stride`` logits, the array ``skew`` logits past a 16-byte boundary."""
        buf = torch.full((batch * stride + skew + 64,), float("nan"), dtype=tdtype, device="cuda")
        rows = buf[skew : skew + batch * stride].view(batch, stride)[:, :vocab]
        rows.copy_(x)
        assert buf.data_ptr() % 16 == 0
        return rows

    def calls(rows):
        plain = torch_logprob_rank(rows, ids, temperature=temp)
        top = torch_logprob_rank(rows, ids, top_k=20, temperature=temp)
        greedy = torch_logprob_rank(rows, gids, argmax=True, temperature=temp)
        return (
            plain.logprobs,
            plain.ranks,
            top.logprobs,
            top.ranks,
            top.topk_logprobs,
            top.topk_ids,
            greedy.logprobs,
            greedy.ranks,
            greedy.argmax,
        )

    ref = calls(laid_out(aligned, 0))
    assert ref[0].isfinite().all()
    for stride, skew in ((vocab, 0), (vocab + 1, 0), (aligned, 3), (vocab + 3, 5), (aligned + 8, 7)):
        got = calls(laid_out(stride, skew))
        for i, (a, b) in enumerate(zip(ref, got)):
            a, b = (a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else (a, b)
            assert torch.equal(a, b), f"{dtype} temp {with_temp} vocab {vocab} stride {stride} skew {skew} output {i}"
    xs = x[:8].float()
    if with_temp:
        xs = xs / temp[:8, None]
    assert_matches_reference(
        xs.cpu().numpy(),
        ids[:8].cpu().numpy(),
        ref[0][:8].cpu().numpy(),
        ref[1][:8].cpu().numpy(),
        f"gpu {dtype} temp {with_temp} vocab {vocab}",
    )


@pytest.mark.gpu
@needs_gpu
def test_gpu_more_than_2_31_logits():
    """15,000 x 151,936 bf16 (2.28e9 logits): int64 offsets; the last rows exact and equal in bits
    to the same rows alone."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    batch = 15000
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs 16 GiB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(9)
    base = torch.empty(batch, GPU_VOCAB, dtype=torch.bfloat16, device="cuda")
    for r0 in range(0, batch, 1000):
        base[r0 : r0 + 1000] = torch.randn(min(1000, batch - r0), GPU_VOCAB, device="cuda", generator=g) * 4
    ids = torch.randint(0, GPU_VOCAB, (batch,), device="cuda", generator=g)
    assert base.numel() > 2**31
    res = torch_logprob_rank(base, ids, top_k=8)
    tail = slice(batch - 6, batch)
    alone = torch_logprob_rank(base[tail].contiguous(), ids[tail].contiguous(), top_k=8)
    assert torch.equal(res.logprobs[tail].view(torch.int32), alone.logprobs.view(torch.int32))
    x = base[tail].float().cpu().numpy()
    assert_matches_reference(
        x,
        ids[tail].cpu().numpy(),
        res.logprobs[tail].cpu().numpy(),
        res.ranks[tail].cpu().numpy(),
        "gpu 15000 rows, last rows",
    )
    assert_topk(x, 8, res.topk_logprobs[tail].cpu().numpy(), res.topk_ids[tail].cpu().numpy(), "gpu 15000 top-k")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("top_k", [1, 5, 20, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_topk_exact_and_special_rows(top_k, dtype):
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(top_k)
    for vocab, block in ((GPU_VOCAB, 4096), (1000, 1024), (9000, 4096)):
        x, ids = special_rows(vocab, block, rng)
        xt, idst, temp = tied_case(rng, 7, vocab, dtype, top_k)
        x = np.concatenate([round_to(x, dtype), xt])
        ids = np.concatenate([ids, idst])
        temp = np.concatenate([np.ones(10, np.float32), temp])
        logits = torch.from_numpy(x).to(TORCH_DTYPES[dtype]).cuda()
        res = torch_logprob_rank(
            logits, torch.from_numpy(ids).cuda(), top_k=top_k, temperature=torch.from_numpy(temp).cuda()
        )
        y = processed(x, temp)
        assert_matches_reference(y, ids, res.logprobs.cpu().numpy(), res.ranks.cpu().numpy(), f"gpu v{vocab}")
        assert_topk(y, top_k, res.topk_logprobs.cpu().numpy(), res.topk_ids.cpu().numpy(), f"gpu v{vocab} k{top_k}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_workspace_size_is_enforced_for_topk():
    logits = torch.randn(4, 1000, device="cuda")
    ids = torch.zeros(4, dtype=torch.int64, device="cuda")
    lp, rk = (
        torch.full((4,), POISON_LOGPROB, device="cuda"),
        torch.full((4,), POISON_RANK, device="cuda", dtype=torch.int64),
    )
    tlp = torch.full((4, 20), POISON_LOGPROB, device="cuda")
    tid = torch.full((4, 20), POISON_RANK, device="cuda", dtype=torch.int64)
    need = logprob_rank_workspace_bytes(4, 1000, 20)
    ws = torch.empty(need - 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=rf"^workspace must hold at least {need} bytes"):
        token_logprob_rank(
            logits,
            ids,
            out_logprobs=lp,
            out_ranks=rk,
            stream=0,
            workspace=ws,
            top_k=20,
            out_topk_logprobs=tlp,
            out_topk_ids=tid,
        )
    torch.cuda.synchronize()
    assert (tlp == POISON_LOGPROB).all() and (lp == POISON_LOGPROB).all()
