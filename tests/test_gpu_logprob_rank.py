"""token_logprob_rank on the GPU (marked ``gpu``, skipped without one): the size grid, strided
rows, special values, workspace errors, a side stream and a CUDA graph, bound calls and the
adapter's cache; against the float64 reference with the tolerance of ``test_logprob_rank.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.logprob_cases import (  # noqa: E402
    BATCHES,
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    VOCABS,
    assert_matches_reference,
    assert_planted,
    assert_special,
    huge_case,
    make_case,
    round_to,
    special_case,
)

from trace_replay_core import bind_logprob_rank, token_logprob_rank  # noqa: E402
from trace_replay_core._logprob import logprob_rank_workspace_bytes  # noqa: E402


def _cuda_available() -> bool:
    return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def _gpu_logits(x: np.ndarray, dtype: str, pad: int = 0):
    batch, vocab = x.shape
    wide = torch.full((batch, vocab + pad), float("nan"), dtype=TORCH_DTYPES[dtype], device="cuda")
    wide[:, :vocab] = torch.from_numpy(x).to("cuda").to(TORCH_DTYPES[dtype])
    return wide[:, :vocab]


GPU_GRID = [(b, v, d) for d in TORCH_DTYPES for b in BATCHES for v in VOCABS]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,vocab,dtype", GPU_GRID, ids=[f"b{b}-v{v}-{d}" for b, v, d in GPU_GRID])
def test_gpu_matches_reference(batch, vocab, dtype):
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(batch * 7919 + vocab)
    x, ids = make_case(rng, batch, vocab, dtype)
    logits = _gpu_logits(x, dtype)
    lp, rk = torch_logprob_rank(logits, torch.from_numpy(ids).cuda())
    assert lp.dtype == torch.float32 and rk.dtype == torch.int64
    assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), f"gpu {batch}x{vocab} {dtype}")
    assert_planted(x, ids, rk.cpu().numpy())


STRIDED = [(b, v, d, pad) for d in TORCH_DTYPES for b in (1, 7, 256) for v in (1000, 151936) for pad in (8, 3)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,vocab,dtype,pad", STRIDED, ids=[f"b{b}-v{v}-{d}-pad{p}" for b, v, d, p in STRIDED])
def test_gpu_row_strided(batch, vocab, dtype, pad):
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(vocab + pad)
    x, ids = make_case(rng, batch, vocab, dtype)
    logits = _gpu_logits(x, dtype, pad)  # pad 3: rows not 16-byte aligned (scalar loads)
    assert logits.stride(0) == vocab + pad
    lp = torch.full((batch,), POISON_LOGPROB, device="cuda")
    rk = torch.full((batch,), POISON_RANK, dtype=torch.int32, device="cuda")
    ids_t = torch.from_numpy(ids).to(torch.int32).cuda()
    out = torch_logprob_rank(logits, ids_t, out=(lp, rk))
    assert out[0] is lp and out[1] is rk
    assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), f"gpu strided {batch}x{vocab}+{pad}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("vocab", [300, 151936])
def test_gpu_special_values(dtype, vocab):
    x, ids, expect = special_case(vocab)
    x = round_to(x, dtype)
    logits = _gpu_logits(x, dtype)
    ids_t = torch.from_numpy(ids).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    for extra in (0, 4096):  # an exact and a larger (poisoned) workspace
        lp = torch.full((10,), POISON_LOGPROB, device="cuda")
        rk = torch.full((10,), POISON_RANK, dtype=torch.int64, device="cuda")
        ws = torch.full((logprob_rank_workspace_bytes(10, vocab) + extra,), 0xFF, dtype=torch.uint8, device="cuda")
        token_logprob_rank(logits, ids_t, out_logprobs=lp, out_ranks=rk, stream=stream, workspace=ws)
        assert_special(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), expect, f"gpu special {dtype} extra={extra}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("vocab", [3000, 151936])
def test_gpu_logits_beyond_2_20(dtype, vocab):
    """Rows masked with finfo.min, logits of +-3e38 and rows near -1.5e38: the bfloat16 fast path
    flags such chunks and the combine kernel re-sums those that matter (huge_case's rows)."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    x, ids = huge_case(vocab)
    x = round_to(x, dtype)
    if dtype == "float16":  # beyond float16's range: only -inf masks there
        x = np.where(np.abs(x) > 6e4, -np.inf, x).astype(np.float32)
    logits = _gpu_logits(x, dtype)
    lp, rk = torch_logprob_rank(logits, torch.from_numpy(ids).cuda())
    lp, rk = lp.cpu().numpy(), rk.cpu().numpy()
    assert_matches_reference(x, ids, lp, rk, f"gpu beyond 2**20 {dtype} {vocab}")
    one, _ = torch_logprob_rank(logits[1:2], torch.from_numpy(ids[1:2]).cuda())
    assert one.cpu().numpy().view(np.uint32)[0] == lp.view(np.uint32)[1]  # the same bits alone


@pytest.mark.gpu
@needs_gpu
def test_gpu_launch_forms_on_sm90():
    """On sm_90+ a call without top-k whose rows' clusters fit on the device at once is one
    launch of the chunk kernel, a row's programs in one cluster whose first merges the row,
    queued as a programmatic dependent launch; with top-k, or more rows than that, the combine
    kernel follows as one. Before sm_90, two ordinary launches. Both forms give the reference's
    results, with the same bits (the merge is the same code in either kernel)."""
    from trace_replay_core.kernels.logprob_rank import (
        LogprobRankArgs,
        LogprobRankDtypes,
        _compiled_launches,
        bind_logprob_rank_launch,
    )

    sm90 = torch.cuda.get_device_capability()[0] >= 9
    x = torch.randn(3, 1000, device="cuda").bfloat16()
    ids = torch.tensor([1, 2, 3], device="cuda")
    out = {}
    for k in (0, 8):
        lp, rk = torch.full((3,), POISON_LOGPROB, device="cuda"), torch.full((3,), POISON_RANK, device="cuda")
        tlp, tid = torch.full((3, 8), POISON_LOGPROB, device="cuda"), torch.full((3, 8), POISON_RANK, device="cuda")
        ws = torch.empty(logprob_rank_workspace_bytes(3, 1000, top_k=k), dtype=torch.uint8, device="cuda")
        args = LogprobRankArgs(
            x.data_ptr(),
            ids.data_ptr(),
            0,
            lp.data_ptr(),
            rk.data_ptr(),
            tlp.data_ptr() if k else 0,
            tid.data_ptr() if k else 0,
            ws.data_ptr(),
            3,
            1000,
            x.stride(0),
            k,
        )
        dtypes = LogprobRankDtypes("bfloat16", "int64", "int64", "int64")
        variant, launches = _compiled_launches(args, dtypes, 0, None)
        forms = (variant.gdc, variant.cluster, len(launches))
        if not sm90:
            assert forms == (False, False, 2)
        elif k:
            assert forms == (True, False, 2), forms
        else:
            assert forms == (True, True, 1) and launches[0][1][1] >= 1, forms
        bind_logprob_rank_launch(args, dtypes, 0)(torch.cuda.current_stream().cuda_stream)
        assert_matches_reference(
            x.float().cpu().numpy(), ids.cpu().numpy(), lp.cpu().numpy(), rk.cpu().numpy(), f"launch form top_k={k}"
        )
        out[k] = (lp.clone(), rk.clone())
    assert torch.equal(out[0][0].view(torch.int32), out[8][0].view(torch.int32)) and torch.equal(out[0][1], out[8][1])
    # 4096 rows of 151,936 (13 chunks): more rows than 13-program clusters fit at once (compiled
    # only; nothing is launched, so the addresses are never read).
    big = LogprobRankArgs(16, 32, 0, 48, 64, 0, 0, 80, 4096, 151936, 151936, 0)
    variant, launches = _compiled_launches(big, dtypes, 0, None)
    assert len(launches) == 2 and not variant.cluster


@pytest.mark.gpu
@needs_gpu
def test_gpu_chained_calls_read_what_the_kernel_before_wrote():
    """Bound calls queue the chunk kernel as a programmatic dependent launch of the kernel before
    it (sm_90+): it must still see that kernel's writes. Each call here follows, with no
    synchronisation, the kernels that rewrite its logits and ids (and the previous call); every
    call must match the reference for what was written just before it."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(77)
    batch, vocab, calls = 64, 151936, 12
    cases = [make_case(rng, batch, vocab, "bfloat16") for _ in range(3)]
    srcs = [(torch.from_numpy(x).to(torch.bfloat16).cuda(), torch.from_numpy(ids).cuda()) for x, ids in cases]
    logits = torch.empty(batch, vocab, dtype=torch.bfloat16, device="cuda")
    ids_t = torch.empty(batch, dtype=torch.int64, device="cuda")
    lps = torch.full((calls, batch), POISON_LOGPROB, device="cuda")
    rks = torch.full((calls, batch), POISON_RANK, dtype=torch.int64, device="cuda")
    logits.copy_(srcs[0][0])
    ids_t.copy_(srcs[0][1])
    torch_logprob_rank(logits, ids_t, out=(lps[0], rks[0]))  # compiled and bound before the loop
    torch.cuda.synchronize()
    for k in range(calls):
        logits.copy_(srcs[k % 3][0])
        ids_t.copy_(srcs[k % 3][1])
        torch_logprob_rank(logits, ids_t, out=(lps[k], rks[k]))
    torch.cuda.synchronize()
    for k in range(calls):
        x, ids = cases[k % 3]
        assert_matches_reference(x, ids, lps[k].cpu().numpy(), rks[k].cpu().numpy(), f"chained call {k}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_workspace_errors_change_nothing():
    logits = torch.randn(4, 151936, device="cuda")
    ids = torch.zeros(4, dtype=torch.int64, device="cuda")
    lp = torch.full((4,), POISON_LOGPROB, device="cuda")
    rk = torch.full((4,), POISON_RANK, dtype=torch.int64, device="cuda")
    need = logprob_rank_workspace_bytes(4, 151936)
    assert need > 0
    small = torch.empty(need - 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=rf"^workspace must hold at least {need} bytes"):
        token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0, workspace=small)
    with pytest.raises(ValueError, match=rf"^workspace must be given on a GPU: this call needs {need} bytes"):
        token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    with pytest.raises(ValueError, match=r"^out_ranks must be on cuda:0 \(got cpu\)"):
        token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=torch.empty(4, dtype=torch.int64), stream=0)
    torch.cuda.synchronize()
    assert (lp == POISON_LOGPROB).all() and (rk == POISON_RANK).all()


@pytest.mark.gpu
@needs_gpu
def test_gpu_side_stream_and_cuda_graph():
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(5)
    x, ids = make_case(rng, 7, 32000, "bfloat16")
    logits = _gpu_logits(x, "bfloat16").contiguous()
    ids_t = torch.from_numpy(ids).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # runs on the side stream, as torch's current one
        lp, rk = torch_logprob_rank(logits, ids_t)
    torch.cuda.current_stream().wait_stream(side)
    assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), "gpu side stream")
    # Capture (after the warm-up above compiled the kernels), then replay on new logits.
    static_out = (torch.empty(7, device="cuda"), torch.empty(7, dtype=torch.int64, device="cuda"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch_logprob_rank(logits, ids_t, out=static_out)
    x2, ids2 = make_case(np.random.default_rng(6), 7, 32000, "bfloat16")
    logits.copy_(torch.from_numpy(x2).to(torch.bfloat16).cuda())
    ids_t.copy_(torch.from_numpy(ids2).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(x2, ids2, static_out[0].cpu().numpy(), static_out[1].cpu().numpy(), "gpu graph")


@pytest.mark.gpu
@needs_gpu
def test_gpu_bound_calls_and_adapter_cache_follow_the_buffers():
    """The adapter binds once per tensor layout: a hit must read the tensors' current contents,
    and new tensors (new addresses) must never be served a launch bound to old ones."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    rng = np.random.default_rng(41)
    for batch in (3, 300):
        logits = torch.empty(batch, 5000, dtype=torch.bfloat16, device="cuda")
        ids_t = torch.empty(batch, dtype=torch.int64, device="cuda")
        out = (torch.empty(batch, device="cuda"), torch.empty(batch, dtype=torch.int64, device="cuda"))
        for k in range(4):  # same buffers, new contents
            x, ids = make_case(rng, batch, 5000, "bfloat16")
            logits.copy_(torch.from_numpy(x).to(torch.bfloat16))
            ids_t.copy_(torch.from_numpy(ids))
            out[0].fill_(POISON_LOGPROB)
            out[1].fill_(POISON_RANK)
            torch_logprob_rank(logits, ids_t, out=out)
            assert_matches_reference(x, ids, out[0].cpu().numpy(), out[1].cpu().numpy(), f"hit {batch} {k}")
        kept = []
        for k in range(4):  # new buffers every call
            x, ids = make_case(rng, batch, 5000, "bfloat16")
            lg = _gpu_logits(x, "bfloat16", pad=8 * k)
            lp, rk = torch_logprob_rank(lg, torch.from_numpy(ids).cuda())
            kept.append(lg)  # keep addresses distinct
            assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), f"miss {batch} {k}")
    # The core's bound call on its own, on a side stream.
    x, ids = make_case(rng, 5, 151936, "float32")
    logits = _gpu_logits(x, "float32")
    lp = torch.full((5,), POISON_LOGPROB, device="cuda")
    rk = torch.full((5,), POISON_RANK, dtype=torch.int32, device="cuda")
    ws = torch.empty(logprob_rank_workspace_bytes(5, 151936), dtype=torch.uint8, device="cuda")
    ids_t = torch.from_numpy(ids).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    bound = bind_logprob_rank(logits, ids_t, out_logprobs=lp, out_ranks=rk, workspace=ws, stream=side.cuda_stream)
    bound(stream=side.cuda_stream)
    side.synchronize()
    assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), "bound side stream")
