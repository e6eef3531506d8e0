"""token_logprob_rank: the numpy backend, the checks and the plan. The data, the reference and the
tolerance (derived in its docstring) are in ``helpers/logprob_cases.py``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.logprob_cases import (  # noqa: E402
    _GOOD,
    BAD,
    CPU_GRID,
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    assert_matches_reference,
    assert_planted,
    assert_special,
    make_case,
    round_to,
    run_core_cpu,
    special_case,
    torch,
)

from trace_replay_core import bind_logprob_rank, token_logprob_rank, token_logprob_rank_reference  # noqa: E402
from trace_replay_core._logprob import logprob_rank_workspace_bytes  # noqa: E402
from trace_replay_core.kernels.logprob_rank import (  # noqa: E402
    LogprobRankArgs,
    LogprobRankDtypes,
    kernel_specs,
    plan_for_call,
    plan_logprob_rank,
    workspace_layout,
)


@pytest.mark.parametrize("batch,vocab,dtype", CPU_GRID, ids=[f"b{b}-v{v}-{d}" for b, v, d in CPU_GRID])
def test_cpu_backend_matches_reference(batch, vocab, dtype):
    # Sizes above 2**25 logits (e.g. 1024 x 262,144) run in the GPU tier; the numpy backend
    # processes rows in fixed-size chunks, so larger batches exercise nothing new here.
    rng = np.random.default_rng(batch * 1_000_003 + vocab)
    x, ids = make_case(rng, batch, vocab, dtype)
    lp, rk = run_core_cpu(x, ids, dtype)
    assert_matches_reference(x, ids, lp, rk, f"cpu {batch}x{vocab} {dtype}")
    assert_planted(x, ids, rk)


def test_cpu_backend_hand_computed():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, -np.inf, 4.0, -1.5]], dtype=np.float32)
    lp = np.full(8, POISON_LOGPROB, dtype=np.float32)
    rk = np.full(8, POISON_RANK, dtype=np.int64)
    logits = np.repeat(x, 4, axis=0)
    ids = np.array([1, 2, 0, 3, 0, 2, 1, 3], dtype=np.int32)
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)
    lse0 = np.log(np.exp(1.0) + 2 * np.exp(3.0) + np.exp(2.0))
    lse1 = np.log(np.exp(5.0) + np.exp(4.0) + np.exp(-1.5))
    # Ties count against the token: both 3.0 entries have rank 2; the unique argmax has rank 1.
    assert rk.tolist() == [2, 2, 4, 3, 1, 2, 4, 3]
    want = [3 - lse0, 3 - lse0, 1 - lse0, 2 - lse0, 5 - lse1, 4 - lse1, -np.inf, -1.5 - lse1]
    np.testing.assert_allclose(lp, np.array(want, dtype=np.float32), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_cpu_backend_special_values(dtype):
    x, ids, expect = special_case()
    x = round_to(x, dtype)
    lp, rk = run_core_cpu(x, ids, dtype, rank_dtype=np.int32)
    assert_special(x, ids, lp, rk, expect, f"cpu special {dtype}")


def test_reference_special_values():
    x, ids, expect = special_case()
    lp, rk = token_logprob_rank_reference(x, ids)
    for row, (want_lp, want_rank) in expect.items():
        assert np.isnan(lp[row]) if np.isnan(want_lp) else lp[row] == want_lp, (row, lp[row])
        if want_rank is not None:
            assert rk[row] == want_rank, (row, rk[row])


def test_cpu_backend_strided_rows_and_column_ids():
    rng = np.random.default_rng(3)
    x, ids = make_case(rng, 9, 1000, "bfloat16")
    wide = torch.full((9, 1013), float("nan"), dtype=torch.bfloat16)  # padding would poison a misread
    wide[:, 5:1005] = torch.from_numpy(x).to(torch.bfloat16)
    logits = wide[:, 5:1005]
    assert logits.stride() == (1013, 1)
    lp = torch.full((9,), POISON_LOGPROB)
    rk = torch.full((9,), POISON_RANK, dtype=torch.int64)
    token_logprob_rank(logits, torch.from_numpy(ids)[:, None], out_logprobs=lp, out_ranks=rk, stream=0)
    assert_matches_reference(x, ids, lp.numpy(), rk.numpy(), "cpu strided")
    # Broadcast rows (row stride 0) are fine too.
    row = torch.from_numpy(x[:1]).expand(4, 1000)
    lp4, rk4 = torch.empty(4), torch.empty(4, dtype=torch.int32)
    ids4 = torch.tensor([0, 1, 2, 999])
    token_logprob_rank(row, ids4, out_logprobs=lp4, out_ranks=rk4, stream=0)
    assert_matches_reference(np.repeat(x[:1], 4, axis=0), ids4.numpy(), lp4.numpy(), rk4.numpy(), "cpu broadcast")


def test_cpu_backend_empty_batch_and_read_only_logits():
    lp, rk = np.empty(0, np.float32), np.empty(0, np.int64)
    token_logprob_rank(np.ones((0, 5), np.float32), np.empty(0, np.int64), out_logprobs=lp, out_ranks=rk, stream=0)
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    x.flags.writeable = False
    lp, rk = np.empty(2, np.float32), np.empty(2, np.int64)
    token_logprob_rank(x, np.array([2, 0]), out_logprobs=lp, out_ranks=rk, stream=0)
    assert rk.tolist() == [1, 3]


def test_inputs_may_share_memory():
    """Reading the same memory twice is harmless: a temperature that is a view of the logits'
    own memory (their first row's first entries) gives what a copy of it gives."""
    logits = np.linspace(-3.0, 3.0, 4 * 30, dtype=np.float32).reshape(4, 30)
    logits[0, :4] = [0.7, 1.3, 2.5, 0.4]
    temperature = logits.reshape(-1)[:4]  # shares the logits' memory
    ids = np.array([3, 0, 29, 17])
    got = np.full(4, POISON_LOGPROB, np.float32), np.full(4, POISON_RANK, np.int64)
    want = np.full(4, POISON_LOGPROB, np.float32), np.full(4, POISON_RANK, np.int64)
    token_logprob_rank(logits, ids, out_logprobs=got[0], out_ranks=got[1], temperature=temperature, stream=0)
    token_logprob_rank(logits, ids, out_logprobs=want[0], out_ranks=want[1], temperature=temperature.copy(), stream=0)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tolist() == want[1].tolist()
    assert np.all(np.isfinite(got[0])) and np.all(got[1] >= 1)


def test_bound_call_repeats_the_call_on_new_contents():
    """bind_logprob_rank validates once; each call recomputes from the arrays' current contents."""
    rng = np.random.default_rng(12)
    x, ids = make_case(rng, 6, 700, "float32")
    logits, ids_buf = x.copy(), ids.copy()
    lp = np.full(6, POISON_LOGPROB, np.float32)
    rk = np.full(6, POISON_RANK, np.int64)
    bound = bind_logprob_rank(logits, ids_buf, out_logprobs=lp, out_ranks=rk, stream=0)
    assert np.all(lp == POISON_LOGPROB)  # binding computes nothing
    for k in range(3):
        x, ids = make_case(np.random.default_rng(100 + k), 6, 700, "float32")
        logits[...] = x
        ids_buf[...] = ids
        bound(stream=0)
        assert_matches_reference(x, ids, lp, rk, f"bound call {k}")
    with pytest.raises(TypeError, match=r"^stream must be given explicitly"):
        bound(stream=None)
    with pytest.raises(ValueError, match=r"^out_logprobs must have 6 rows"):
        bind_logprob_rank(logits, ids_buf, out_logprobs=lp[:5], out_ranks=rk, stream=0)


@pytest.mark.parametrize("case", list(BAD))
def test_errors_name_the_argument_and_change_nothing(case):
    override, exc, pattern = BAD[case]
    kwargs = dict(
        _GOOD,
        out_logprobs=np.full(3, POISON_LOGPROB, np.float32),
        out_ranks=np.full(3, POISON_RANK, np.int64),
        stream=0,
    )
    kwargs.update(override)
    lp, rk = kwargs["out_logprobs"], kwargs["out_ranks"]
    before_lp, before_rk = np.array(lp, copy=True), np.array(rk, copy=True)
    with pytest.raises(exc, match=pattern):
        token_logprob_rank(kwargs.pop("logits"), kwargs.pop("token_ids"), **kwargs)
    np.testing.assert_array_equal(lp, before_lp)
    np.testing.assert_array_equal(rk, before_rk)


def test_row_split_depends_on_the_vocabulary_only():
    # Rows are cut into chunks of whole blocks of a size chosen from the vocabulary alone, whatever
    # the batch, dtype, top-k, layout or device: that is what makes the results batch-invariant.
    for vocab in (1, 1000, 4097, 32000, 50257, 151936, 262144, 2**30):
        p = plan_logprob_rank(1, vocab)
        assert p.block & (p.block - 1) == 0 and 128 <= p.block <= 2048 and p.n_chunks <= 256
        span = p.chunk_blocks * p.block  # logits per chunk
        assert (p.n_chunks - 1) * span < vocab <= p.n_chunks * span  # no empty chunk
        for batch, dtype, top_k, aligned, flag in itertools.product(
            (1, 7, 4096), ("bfloat16", "float32", "float16"), (0, 20, 64), (True, False), (True, False)
        ):
            v = plan_logprob_rank(batch, vocab, dtype, top_k, aligned=aligned, temperature=flag, argmax=flag, sm90=flag)
            assert (v.block, v.chunk_blocks, v.n_chunks) == (p.block, p.chunk_blocks, p.n_chunks), (batch, vocab)
            assert v.k_pad >= top_k and v.k_pad in (0, 8, 32, 64)


def test_plans_of_known_vocabularies():
    # (block, chunk_blocks, n_chunks) pinned; vocabularies that leave contiguous rows unaligned
    # (50,257, 10,001) take chunks of at least 4 blocks, in every dtype.
    for vocab, split in ((151936, (2048, 6, 13)), (32000, (2048, 2, 8)), (50257, (2048, 4, 7)), (10001, (2048, 4, 2))):
        for dtype in ("bfloat16", "float32"):
            v = plan_logprob_rank(256, vocab, dtype)
            assert (v.block, v.chunk_blocks, v.n_chunks) == split, vocab
    assert plan_logprob_rank(1, 151937).chunk_blocks == 6  # already longer than 4 blocks
    # The combine kernel holds a row's partials in one tile: a tuning override that would cut a
    # row into more than 256 chunks is refused, by name, before anything is compiled.
    assert plan_logprob_rank(1, 2**20, chunk_blocks=2).n_chunks == 256
    with pytest.raises(ValueError, match=r"chunk_blocks=1 cuts rows of 1048576 logits into more than 256 chunks"):
        plan_logprob_rank(1, 2**20, chunk_blocks=1)
    with pytest.raises(ValueError, match=r"dtype must be one of .* \(got 'int8'\)"):
        plan_logprob_rank(1, 1000, "int8")
    # Chunks per program: from the batch (speed only); the grid still covers every chunk once.
    groups = [plan_logprob_rank(b, 151936).group for b in (1, 256, 292, 293, 511, 512, 4096)]
    assert groups == [1, 1, 1, 2, 2, 4, 4]
    assert [plan_logprob_rank(b, 151936, top_k=20).group for b in (1, 146, 147, 4096)] == [1, 1, 2, 2]
    assert [plan_logprob_rank(1, 1000, top_k=k).k_pad for k in (0, 1, 8, 9, 20, 32, 33, 64)] == [
        0,
        8,
        8,
        32,
        32,
        32,
        64,
        64,
    ]


def test_variant_choices_and_cache():
    # One plan per (batch, vocabulary, dtype, top-k, options), computed once: the same object.
    assert plan_logprob_rank(256, 151936, "bfloat16") is plan_logprob_rank(256, 151936, "bfloat16")
    plain = plan_logprob_rank(64, 151936, "bfloat16", sm90=True)
    assert plain.words and plain.packed_count and plain.gdc and plain.cluster and not plain.shift
    assert len(kernel_specs(plain, LogprobRankDtypes("bfloat16", "int64", "int64"))) == 1  # merged in clusters
    # Only bfloat16 without a temperature takes the fused path; top-k is never clustered and its
    # chunk kernel is capped at 64 registers; the interpreter's plan has no inline PTX.
    assert not plan_logprob_rank(64, 151936, "bfloat16", temperature=True).words
    assert not plan_logprob_rank(64, 151936, "float32").words
    topk = plan_logprob_rank(64, 151936, "bfloat16", 20, sm90=True)
    assert not topk.cluster and topk.maxnreg == 64 and topk.sel == 128
    assert len(kernel_specs(topk, LogprobRankDtypes("bfloat16", "int64", "int64"))) == 2
    assert not plan_logprob_rank(64, 151936, "bfloat16", inline_ptx=False).packed_count
    assert not plan_logprob_rank(64, 151936, "bfloat16", sm90=True, cluster=False).cluster
    assert not plan_logprob_rank(64, 2**20, "bfloat16", sm90=True, chunk_blocks=2).cluster  # 256 chunks
    # float32 rows that are not aligned, with top-k: the element path's block loop not unrolled.
    assert plan_logprob_rank(64, 50257, "float32", 20, aligned=False).unroll == 1
    assert plan_logprob_rank(64, 50257, "float32", 20, aligned=False, argmax=True).unroll == 2


WORKSPACE_REFUSALS = {  # (batch, vocab, top_k) -> error, anchored message
    "vocab-zero": ((4, 0, 0), ValueError, r"^vocab must be between 1 and 1073741824 \(got 0\)$"),
    "vocab-negative": ((4, -7, 0), ValueError, r"^vocab must be between 1 and 1073741824 \(got -7\)$"),
    "vocab-float": ((4, 1000.0, 0), TypeError, r"^vocab must be an int \(got float 1000\.0\)$"),
    "batch-negative": ((-3, 1000, 0), ValueError, r"^batch must be between 0 and 2147483647 \(got -3\)$"),
    "batch-float": ((2.5, 1000, 0), TypeError, r"^batch must be an int \(got float 2\.5\)$"),
    "top-k-too-large": ((4, 1000, 65), ValueError, r"^top_k must be between 0 and 64 .*\(got 65\)$"),
    "top-k-above-vocab": ((4, 5, 6), ValueError, r"^top_k must be between 0 and 5 .*\(got 6\)$"),
    "top-k-negative": ((4, 1000, -1), ValueError, r"^top_k must be between 0 and 64 .*\(got -1\)$"),
}


@pytest.mark.parametrize("case", sorted(WORKSPACE_REFUSALS))
def test_workspace_size_refusals(case):
    args, exc, pattern = WORKSPACE_REFUSALS[case]
    with pytest.raises(exc, match=pattern):
        logprob_rank_workspace_bytes(*args)


def test_workspace_size():
    # 24 bytes per chunk and row (max, sum, count, the greedy maximum and column, used with
    # out_argmax, and the entropy's u, used with out_entropy); with top-k, per chunk 8 bytes per
    # kept key and per candidate key and 4 per candidate vector; 8 bytes per row for the token's
    # logit and validity.
    assert logprob_rank_workspace_bytes(0, 151936) == 0
    assert logprob_rank_workspace_bytes(1, 151936) == 6 * 64 + 2 * 16  # 52 and 4 bytes rounded to 16
    assert logprob_rank_workspace_bytes(256, 151936) == 6 * 256 * 13 * 4 + 2 * 256 * 4
    assert logprob_rank_workspace_bytes(256, 151936, 20) == 256 * 13 * (24 + 32 * 8 + 64 * 8 + 128 * 4) + 2 * 256 * 4
    for batch in (1, 3, 1000):
        for vocab in (1, 999, 151936):
            for top_k in (0, 1, 20, 64):
                if top_k > vocab:
                    continue
                plan = plan_logprob_rank(batch, vocab, "float32", top_k)
                offsets = workspace_layout(batch, plan)
                assert all(o % 16 == 0 for o in offsets)
                assert offsets[-1] == logprob_rank_workspace_bytes(batch, vocab, top_k)
                per_chunk = 24 + (8 * plan.k_pad + 16 * plan.k_pad + 16 * plan.k_pad if top_k else 0)
                assert offsets[-1] >= batch * plan.n_chunks * per_chunk + 8 * batch


def test_kernels_follow_the_layout_of_contiguous_rows_at_every_batch_size():
    """Whether rows count as 16-byte aligned picks the compiled kernels (whether each line's
    words are shifted into place: the same bits either way by design, and speed), so it must not
    change with the batch: contiguous rows of a vocabulary are aligned alike at every batch size,
    one row alone included, whatever stride a one-row layout reports below the vocabulary.
    bfloat16 takes the fused path in every layout."""

    def variant(batch, vocab, stride, dtype, base=1 << 20):
        args = LogprobRankArgs(base, 2 << 20, 0, 3 << 20, 4 << 20, 0, 0, 5 << 20, batch, vocab, stride, 0)
        return plan_for_call(args, LogprobRankDtypes(dtype, "int64", "int64"))

    for dtype, itemsize in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        for vocab in (151936, 50257, 32000, 1001, 1000, 1):
            aligned = vocab * itemsize % 16 == 0
            for batch, stride in ((1, vocab), (1, 0), (1, 1), (2, vocab), (7, vocab), (1024, vocab)):
                v = variant(batch, vocab, stride, dtype)
                where = f"{dtype} vocab {vocab} batch {batch} stride {stride}"
                assert v.shift == (not aligned) and v.words == (dtype == "bfloat16"), where
            # A layout that changes the alignment: rows padded to 151,939, one of them alone or a
            # batch; an array that starts 2 bytes off a 16-byte boundary.
            assert [variant(b, vocab, 151939, dtype).shift for b in (1, 7)] == [True, True], f"{dtype} {vocab}"
            assert variant(1, vocab, vocab, dtype, base=(1 << 20) + 2).shift
