"""token_logprob_rank with top-k: the numpy backend and the interpreted kernels. The data, the
reference and the checks (and why they suffice) are in ``helpers/topk_cases.py``."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    assert_matches_reference,
    make_case,
    round_to,
)
from helpers.logprob_interpreter import run_cases, run_cases_by_name  # noqa: E402
from helpers.topk_cases import (  # noqa: E402
    _X,
    BAD,
    BATCHES,
    CPU_TOPK,
    assert_same_bits,
    assert_topk,
    invariance_batches,
    processed,
    run_cpu,
    special_rows,
    tied_case,
    torch,
)

from trace_replay_core import token_logprob_rank  # noqa: E402


@pytest.mark.parametrize("batch,vocab,dtype,top_k", CPU_TOPK, ids=[f"b{b}-v{v}-{d}-k{k}" for b, v, d, k in CPU_TOPK])
@pytest.mark.parametrize("with_temp", [False, True])
def test_cpu_topk_and_temperature_match_reference(batch, vocab, dtype, top_k, with_temp):
    rng = np.random.default_rng(batch * 7 + vocab + top_k)
    x, ids, temp = tied_case(rng, batch, vocab, dtype, top_k)
    temp = temp if with_temp else None
    out = run_cpu(x, ids, dtype, temp=temp, top_k=top_k)
    y = processed(x, temp)
    assert_matches_reference(y, ids, out["lp"], out["rk"], f"cpu {batch}x{vocab}")
    assert_topk(y, top_k, out["tlp"], out["tid"], f"cpu top-{top_k}")


@pytest.mark.parametrize("top_k", [1, 5, 20, 64])
def test_cpu_special_rows(top_k):
    vocab = 1000
    x, ids = special_rows(vocab, 128, np.random.default_rng(3))
    out = run_cpu(x, ids, "float32", top_k=top_k)
    assert_matches_reference(x, ids, out["lp"], out["rk"], "cpu special")
    assert_topk(x, top_k, out["tlp"], out["tid"], "cpu special top-k")
    assert out["tid"][0, :3].tolist() == sorted(out["tid"][0, :3].tolist(), key=lambda i: (-x[0, i], i))
    assert out["tid"][7, :2].tolist() == [1, vocab // 2][:top_k]  # -0.0 ties +0.0: the lower id first
    assert np.all(out["tid"][4] == -1) and np.all(np.isnan(out["tlp"][4]))


def test_numpy_backend_is_batch_invariant():
    rng = np.random.default_rng(8)
    x, ids, temp = tied_case(rng, 23, 1500, "bfloat16", 20)
    plans = invariance_batches(23, rng)
    results = {
        b: [run_cpu(x[rows], ids[rows], "bfloat16", temp=temp[rows], top_k=20) for rows in batches]
        for b, batches in plans.items()
    }
    assert_same_bits(results, plans, "numpy backend")


def _invariance_cases():
    rng = np.random.default_rng(21)
    cases, index = [], []
    # The interpreter is slow: few chunks per row there.
    for dtype, vocab, block, top_k, with_temp in (
        ("bfloat16", 1000, 512, 5, True),
        ("float32", 300, None, 0, False),
        ("float16", 999, 128, 0, True),
    ):
        x, ids, temp = tied_case(rng, 23, vocab, dtype, max(top_k, 1))
        temp = temp if with_temp else None
        plans = invariance_batches(23, rng)
        for b, batches in plans.items():
            for i, rows in enumerate(batches):
                name = f"{dtype}-v{vocab}-b{b}-{i}"
                cases.append(
                    dict(
                        name=name,
                        x=x[rows],
                        ids=ids[rows],
                        temp=None if temp is None else temp[rows],
                        dtype=dtype,
                        block=block,
                        top_k=top_k,
                    )
                )
        index.append((dtype, vocab, plans, x, ids, temp, top_k))
    return cases, index


@pytest.fixture(scope="module")
def interpreted_invariance(tmp_path_factory):
    cases, index = _invariance_cases()
    return run_cases(cases, str(tmp_path_factory.mktemp("inv"))), index


def _topk_cases():
    rng = np.random.default_rng(5)
    cases = []
    for top_k, vocab, block in ((1, 600, 128), (5, 600, 128), (20, 600, 128), (64, 300, None)):
        x, ids = special_rows(vocab, block or 512, rng)
        cases.append(dict(name=f"special-v{vocab}-k{top_k}", x=x, ids=ids, dtype="float32", block=block, top_k=top_k))
        x, ids, temp = tied_case(rng, 3, 2100, "bfloat16", top_k)
        cases.append(
            dict(name=f"tied-bf16-k{top_k}", x=x, ids=ids, temp=temp, dtype="bfloat16", top_k=top_k, pad=3, shift=1)
        )
        if top_k == 20:  # the same rows with 4 chunks per program (block 256: 9 chunks of 1 block)
            for group in (1, 4):
                cases.append(
                    dict(
                        name=f"tied-bf16-k20-b256-g{group}",
                        x=x,
                        ids=ids,
                        dtype="bfloat16",
                        top_k=20,
                        block=256,
                        group=group,
                    )
                )
    # The real block (vocab 4200: 3 chunks of one block, the last of 104 logits), aligned bfloat16
    # rows without a temperature (the fused path); row 8 runs the piecewise merge.
    x, ids = special_rows(4200, 2048, rng)
    cases.append(dict(name="special-v4200-k20", x=round_to(x, "bfloat16"), ids=ids, dtype="bfloat16", top_k=20))
    cases.append(
        dict(
            name="vocab1-k1",
            x=np.array([[0.5], [-np.inf], [np.nan]], np.float32),
            ids=np.array([0, 0, 1]),
            dtype="float32",
            top_k=1,
        )
    )
    x, ids = make_case(rng, 3, 1000, "float32")
    cases.append(dict(name="top0-same-bits", x=x, ids=ids, dtype="float32", top_k=0))
    cases.append(dict(name="top20-same-bits", x=x, ids=ids, dtype="float32", top_k=20))
    cases.append(dict(name="t1-same-bits", x=x, ids=ids, temp=np.ones(3, np.float32), dtype="float32", top_k=0))
    return cases


@pytest.fixture(scope="module")
def interpreted_topk(tmp_path_factory):
    return run_cases_by_name(_topk_cases(), str(tmp_path_factory.mktemp("topk")))


def test_kernels_in_interpreter_are_batch_invariant_and_exact(interpreted_invariance):
    out, index = interpreted_invariance
    for dtype, vocab, plans, x, ids, temp, top_k in index:
        results = {b: [out[f"{dtype}-v{vocab}-b{b}-{i}"] for i in range(len(batches))] for b, batches in plans.items()}
        assert_same_bits(results, plans, f"interpreter {dtype} v{vocab}")
        whole = results[max(BATCHES)][0]
        rows = plans[max(BATCHES)][0]
        y = processed(x[rows], None if temp is None else temp[rows])
        assert_matches_reference(y, ids[rows], whole["lp"], whole["rk"], f"interpreter {dtype} v{vocab}")
        if top_k:
            assert_topk(y, top_k, whole["tlp"], whole["tid"], f"interpreter {dtype} v{vocab} top-{top_k}")


@pytest.mark.parametrize(
    "name", [c["name"] for c in _topk_cases() if "same-bits" not in c["name"] and "-g" not in c["name"]]
)
def test_kernels_in_interpreter_topk_special_rows(interpreted_topk, name):
    case, out = interpreted_topk[name]
    y = processed(case["x"], case.get("temp"))
    assert_matches_reference(y, case["ids"], out["lp"], out["rk"], f"interpreter {name}")
    assert_topk(y, case["top_k"], out["tlp"], out["tid"], f"interpreter {name}")


def test_kernels_in_interpreter_topk_and_unit_temperature_agree(interpreted_topk):
    # T = 1 runs the same kernels as no temperature: the same bits. A call with top-k runs the
    # chunk kernel with the top-k step on the same plan: the same logprob and rank bits too.
    base = interpreted_topk["top0-same-bits"][1]
    unit = interpreted_topk["t1-same-bits"][1]
    assert unit["lp"].tobytes() == base["lp"].tobytes() and unit["rk"].tobytes() == base["rk"].tobytes()
    topk = interpreted_topk["top20-same-bits"][1]
    assert topk["lp"].tobytes() == base["lp"].tobytes() and topk["rk"].tobytes() == base["rk"].tobytes()


def test_kernels_in_interpreter_topk_chunks_per_program_change_no_bit(interpreted_topk):
    # Four chunks per program select from 4 blocks at once (one threshold, one candidate set):
    # the same top-k (an exact set), logprobs and ranks as one chunk per program.
    case, one = interpreted_topk["tied-bf16-k20-b256-g1"]
    four = interpreted_topk["tied-bf16-k20-b256-g4"][1]
    for k in ("lp", "rk", "tlp", "tid"):
        assert one[k].tobytes() == four[k].tobytes(), k
    assert_topk(processed(case["x"], None), 20, one["tlp"], one["tid"], "interpreter block 256")


@pytest.mark.parametrize("case", list(BAD))
def test_errors_name_the_argument_and_change_nothing(case):
    override, exc, pattern = BAD[case]
    lp, rk = np.full(3, POISON_LOGPROB, np.float32), np.full(3, POISON_RANK, np.int64)
    kwargs = dict(out_logprobs=lp, out_ranks=rk, stream=0) | override
    outs = [a for a in kwargs.values() if isinstance(a, np.ndarray)]
    before = [a.copy() for a in outs]
    with pytest.raises(exc, match=pattern):
        token_logprob_rank(_X, np.zeros(3, np.int64), **kwargs)
    for a, b in zip(outs, before):
        assert a.tobytes() == b.tobytes()


def test_torch_adapter_cpu_named_results_and_out():
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank
    from trace_replay_torch.logprob import LogprobRank, LogprobRankTopK

    rng = np.random.default_rng(4)
    x, ids, temp = tied_case(rng, 6, 500, "float32", 5)
    logits, ids_t = torch.from_numpy(x), torch.from_numpy(ids)
    plain = torch_logprob_rank(logits, ids_t)
    assert isinstance(plain, LogprobRank)
    lp, rk = plain
    assert_matches_reference(x, ids, lp.numpy(), rk.numpy(), "torch cpu")
    res = torch_logprob_rank(logits, ids_t, top_k=5, temperature=torch.from_numpy(temp))
    assert isinstance(res, LogprobRankTopK) and res.topk_ids.dtype == torch.int64 and res.topk_ids.shape == (6, 5)
    y = processed(x, temp)
    assert_matches_reference(y, ids, res.logprobs.numpy(), res.ranks.numpy(), "torch cpu temperature")
    assert_topk(y, 5, res.topk_logprobs.numpy(), res.topk_ids.numpy(), "torch cpu top-k")
    out = (torch.empty(6), torch.empty(6, dtype=torch.int32), torch.empty(6, 5), torch.empty(6, 5, dtype=torch.int32))
    got = torch_logprob_rank(logits, ids_t, top_k=5, temperature=0.5, out=out)
    assert all(a is b for a, b in zip(got, out))
    assert_topk(processed(x, np.full(6, 0.5, np.float32)), 5, out[2].numpy(), out[3].numpy(), "torch cpu out")
    zero = torch_logprob_rank(logits, ids_t, temperature=0.0)  # never an error: the rows read as NaN
    assert np.isnan(zero.logprobs.numpy()).all() and (zero.ranks.numpy() == 0).all()
    with pytest.raises(TypeError, match=r"^out must be a \(logprobs, ranks, topk_logprobs, topk_ids\) tuple"):
        torch_logprob_rank(logits, ids_t, top_k=5, out=out[:2])


@pytest.mark.parametrize("method", ["kernel", "jnp"])
def test_jax_adapter_cpu_topk_and_temperature(method):
    import jax
    import jax.numpy as jnp

    from trace_replay_jax import token_logprob_rank as jax_logprob_rank

    rng = np.random.default_rng(6)
    x, ids, temp = tied_case(rng, 7, 700, "float32", 20)
    for t in (None, temp):
        fn = jax.jit(lambda a, b, c, m=method: jax_logprob_rank(a, b, method=m, top_k=20, temperature=c))
        res = fn(jnp.asarray(x), jnp.asarray(ids, jnp.int32), None if t is None else jnp.asarray(t))
        assert res.topk_ids.dtype == jnp.int32 and res.topk_logprobs.shape == (7, 20)
        y = processed(x, t)
        assert_matches_reference(y, ids, np.asarray(res.logprobs), np.asarray(res.ranks), f"jax {method}")
        assert_topk(y, 20, np.asarray(res.topk_logprobs), np.asarray(res.topk_ids), f"jax {method} top-k")
    lp, rk = jax_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int32), method=method, temperature=2.0)
    assert_matches_reference(processed(x, np.full(7, 2.0, np.float32)), ids, np.asarray(lp), np.asarray(rk), "T=2")
    with pytest.raises(ValueError, match=r"^top_k must be between 0 and 64"):
        jax_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int32), method=method, top_k=65)
    zeros = np.zeros(7, np.float32)
    zero = jax_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int32), method=method, temperature=zeros)
    assert np.isnan(np.asarray(zero.logprobs)).all() and (np.asarray(zero.ranks) == 0).all()
