"""token_logprob_rank on the GPU (marked ``gpu``, skipped without one): the size grid, strided
rows, special values, workspace errors, a side stream and a CUDA graph, bound calls and the
adapter's cache; against the float64 reference with the tolerance of ``test_logprob_rank.py``.
``out_entropy``: the reference of ``helpers/entropy_cases.py`` on decode shapes (151,936 bfloat16,
50,257 float32), with temperature, top-k, argmax and logits beyond 2**20, the same bits at batch
1, 3, 100 and 513 in both launch forms, a bound call in a CUDA graph."""

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


# -- out_entropy ------------------------------------------------------------------------------
# The entropy of each row's softmax from the same read, against the float64 reference of
# helpers/entropy_cases.py (NaN-poisoned outputs, planted rows: uniform, one-hot, near-one-hot,
# one and two finite entries, NaN, +inf, all -inf), on the shapes decode loops use.

ENTROPY_SHAPES = [(b, 151936, "bfloat16") for b in (1, 64, 256)] + [(b, 50257, "float32") for b in (1, 64, 256)]


def _entropy_call(logits, ids_t, **kw):
    """The torch adapter with ``entropy=True`` into poisoned caller buffers; host copies."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    b = logits.shape[0]
    out = [torch.full((b,), POISON_LOGPROB, device="cuda"), torch.full((b,), POISON_RANK, device="cuda")]
    if kw.get("top_k"):
        k = kw["top_k"]
        out += [torch.full((b, k), POISON_LOGPROB, device="cuda"), torch.full((b, k), POISON_RANK, device="cuda")]
    if kw.get("argmax"):
        out.append(torch.full((b,), POISON_RANK, device="cuda"))
    out.append(torch.full((b,), float("nan"), device="cuda"))
    got = torch_logprob_rank(logits, ids_t, entropy=True, out=tuple(out), **kw)
    assert all(g is o for g, o in zip(got, out))
    return tuple(t.cpu().numpy() for t in got)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,vocab,dtype", ENTROPY_SHAPES, ids=[f"b{b}-v{v}-{d}" for b, v, d in ENTROPY_SHAPES])
def test_gpu_entropy_matches_reference(batch, vocab, dtype):
    from helpers.entropy_cases import assert_entropy, entropy_case

    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    x, ids = entropy_case(np.random.default_rng(batch * 31 + vocab), batch, vocab, dtype)
    logits, ids_t = _gpu_logits(x, dtype), torch.from_numpy(ids).cuda()
    lp, rk, ent = _entropy_call(logits, ids_t)
    assert_entropy(x, ent, f"gpu entropy {batch}x{vocab} {dtype}", planted=True)
    assert_matches_reference(x, ids, lp, rk, f"gpu entropy {batch}x{vocab} {dtype}")
    plain_lp, plain_rk = (t.cpu().numpy() for t in torch_logprob_rank(logits, ids_t))
    assert plain_lp.tobytes() == lp.tobytes() and np.array_equal(plain_rk, rk), "entropy changed a logprob or rank"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_entropy_with_temperature_top_k_and_greedy_rows(dtype):
    """The element path (a temperature) with top-k 20 and argmax, every other row greedy: the
    entropy of logits / T, with the bits of a call that asks for the entropy alone."""
    from helpers.entropy_cases import assert_entropy, entropy_case

    from trace_replay_core import greedy_argmax_reference

    rng = np.random.default_rng(64)
    x, ids = entropy_case(rng, 64, 151936, dtype)
    ids[1::2] = -1
    temp = rng.uniform(0.4, 2.0, 64).astype(np.float32)
    logits, ids_t, temp_t = _gpu_logits(x, dtype), torch.from_numpy(ids).cuda(), torch.from_numpy(temp).cuda()
    lp, rk, _, _, am, ent = _entropy_call(logits, ids_t, temperature=temp_t, top_k=20, argmax=True)
    y = x / temp[:, None]
    assert_entropy(y, ent, f"gpu entropy {dtype} T top-k argmax")
    want = np.concatenate([greedy_argmax_reference(y[r : r + 16]) for r in range(0, 64, 16)])
    assert am.tolist() == want.tolist()
    assert_matches_reference(y, np.where(ids < 0, want, ids), lp, rk, f"gpu entropy {dtype} T top-k argmax")
    *_, alone = _entropy_call(logits, ids_t, temperature=temp_t)
    assert alone.tobytes() == ent.tobytes(), "top-k or argmax changed an entropy bit"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("vocab", [3000, 151936])
def test_gpu_entropy_logits_beyond_2_20(vocab):
    """huge_case's rows in bfloat16 (no temperature: the fused path flags chunks whose maximum
    lies beyond 2**20 and the merge re-sums their sum and u): the entropy of each row, the same
    bits alone."""
    from helpers.entropy_cases import assert_entropy

    x, ids = huge_case(vocab)
    x = round_to(x, "bfloat16")
    logits, ids_t = _gpu_logits(x, "bfloat16"), torch.from_numpy(ids).cuda()
    lp, rk, ent = _entropy_call(logits, ids_t)
    assert_entropy(x, ent, f"gpu entropy beyond 2**20 v{vocab}")
    assert_matches_reference(x, ids, lp, rk, f"gpu entropy beyond 2**20 v{vocab}")
    for r in (0, 1, 4, 8):
        *_, one = _entropy_call(logits[r : r + 1], ids_t[r : r + 1])
        assert one.tobytes() == ent[r : r + 1].tobytes(), r


def _core_entropy(logits, ids_t, *, cluster: bool):
    """One core launch with out_entropy, in the cluster form (where the plan allows it) or as
    two kernels: ``(logprobs, ranks, entropy, variant)``, host copies."""
    from trace_replay_core.kernels.logprob_rank import (
        LogprobRankArgs,
        LogprobRankDtypes,
        _compiled_launches,
        launch_logprob_rank,
        plan_for_call,
    )

    b, vocab = logits.shape
    lp, rk = torch.full((b,), POISON_LOGPROB, device="cuda"), torch.full((b,), POISON_RANK, device="cuda")
    ent = torch.full((b,), float("nan"), device="cuda")
    ws = torch.full((logprob_rank_workspace_bytes(b, vocab),), 0xFF, dtype=torch.uint8, device="cuda")
    args = LogprobRankArgs(
        logits.data_ptr(), ids_t.data_ptr(), 0, lp.data_ptr(), rk.data_ptr(), 0, 0, ws.data_ptr(), b, vocab,
        logits.stride(0), 0, 0, ent.data_ptr(),
    )  # fmt: skip
    dtypes = LogprobRankDtypes(str(logits.dtype).removeprefix("torch."), "int64", "int64")
    device = torch.cuda.current_device()
    variant = plan_for_call(args, dtypes, sm90=torch.cuda.get_device_capability()[0] >= 9, cluster=cluster)
    assert variant.entropy
    variant, _ = _compiled_launches(args, dtypes, device, variant)  # the form it runs in (rows that fit)
    launch_logprob_rank(args, dtypes, device, torch.cuda.current_stream().cuda_stream, variant)
    torch.cuda.synchronize()
    return lp.cpu().numpy(), rk.cpu().numpy(), ent.cpu().numpy(), variant


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype,vocab", [("bfloat16", 151936), ("float32", 50257)])
def test_gpu_entropy_batch_invariant_in_both_launch_forms(dtype, vocab):
    """The same rows in batches of 513, 100, 3 and 1 at other positions (batch 513 runs 4 chunks
    per program at 151,936), each batch launched in the cluster form (on sm_90+, where the rows
    fit: one kernel, a row merged by its cluster's first program) and as two kernels: the same
    entropy, logprob and rank bits everywhere; the batch of 513 matches the reference."""
    from helpers.entropy_cases import assert_entropy, entropy_case

    x, ids = entropy_case(np.random.default_rng(513), 513, vocab, dtype)
    logits, ids_t = _gpu_logits(x, dtype), torch.from_numpy(ids).cuda()
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    whole = _core_entropy(logits, ids_t, cluster=False)
    assert_entropy(x, whole[2], f"gpu batch 513 {dtype}", planted=True)
    assert_matches_reference(x, ids, whole[0], whole[1], f"gpu batch 513 {dtype}")
    batches = {513: np.arange(513), 100: np.arange(412, 512)[::-1], 3: np.array([3, 1, 2]), 1: np.array([300])}
    clustered = 0
    for batch, rows in batches.items():
        idx = torch.from_numpy(rows.copy()).cuda()
        sub, sub_ids = logits[idx].contiguous(), ids_t[idx].contiguous()
        for cluster in (False, True):
            lp, rk, ent, variant = _core_entropy(sub, sub_ids, cluster=cluster)
            clustered += variant.cluster
            where = f"{dtype} batch {batch} cluster={variant.cluster}"
            assert ent.tobytes() == whole[2][rows].tobytes(), f"{where}: entropy bits differ"
            assert lp.tobytes() == whole[0][rows].tobytes() and np.array_equal(rk, whole[1][rows]), where
    if sm90:
        assert clustered >= 2, "batches 1 and 3 must have run in the cluster form on sm_90+"


@pytest.mark.gpu
@needs_gpu
def test_gpu_bound_entropy_call_in_a_cuda_graph():
    """A core call bound once (``bind_logprob_rank(..., out_entropy=)``), captured in a CUDA graph
    after a warm-up on a side stream, replayed on new logits: the reference's entropies and the
    bits of an eager call, every replay."""
    from helpers.entropy_cases import assert_entropy, entropy_case

    batch, vocab = 7, 151936
    logits = torch.empty(batch, vocab, dtype=torch.bfloat16, device="cuda")
    ids_t = torch.empty(batch, dtype=torch.int64, device="cuda")
    lp, rk = torch.empty(batch, device="cuda"), torch.empty(batch, dtype=torch.int64, device="cuda")
    ent = torch.empty(batch, device="cuda")
    ws = torch.empty(logprob_rank_workspace_bytes(batch, vocab), dtype=torch.uint8, device="cuda")

    def load(seed):
        x, ids = entropy_case(np.random.default_rng(seed), batch, vocab, "bfloat16")
        logits.copy_(torch.from_numpy(x).to(torch.bfloat16))
        ids_t.copy_(torch.from_numpy(ids))
        return x, ids

    load(40)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and binds off the capture
        bound = bind_logprob_rank(
            logits, ids_t, out_logprobs=lp, out_ranks=rk, out_entropy=ent, workspace=ws, stream=side.cuda_stream
        )
        bound(stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound(stream=torch.cuda.current_stream().cuda_stream)
    for seed in (41, 42, 43):
        x, ids = load(seed)
        ent.fill_(float("nan")), lp.fill_(POISON_LOGPROB), rk.fill_(POISON_RANK)
        graph.replay()
        torch.cuda.synchronize()
        got = ent.cpu().numpy()
        assert_entropy(x, got, f"graph replay, seed {seed}", planted=True)
        assert_matches_reference(x, ids, lp.cpu().numpy(), rk.cpu().numpy(), f"graph replay, seed {seed}")
        *_, eager = _entropy_call(logits, ids_t)
        assert eager.tobytes() == got.tobytes(), f"graph replay, seed {seed}: bits differ from an eager call"
