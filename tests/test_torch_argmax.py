"""CPU tier: ``trace_replay_torch.token_logprob_rank(..., argmax=True)`` and the ``_argmax`` ops.

Each row's greedy token comes from the same read of the logits, and a row whose id is negative
(-1, "not sampled yet") is scored as it. Checked on CPU tensors (the numpy backend, the same
adapter code as on the GPU up to the launch) against ``greedy_argmax_reference`` and the float64
``token_logprob_rank_reference``, with planted ties at the maximum, ``-inf`` and NaN rows; a
greedy row's bits against a call that passes its argmax explicitly; ``out=`` with 3 and 5
tensors; refusals that write nothing; the one-pass greedy step against the two-pass one (argmax,
replay, score), eagerly and compiled through the ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_tokens_equal  # noqa: E402
from helpers.argmax_cases import assert_greedy, greedy_case  # noqa: E402
from helpers.logprob_cases import POISON_LOGPROB, POISON_RANK, TORCH_DTYPES, assert_matches_reference  # noqa: E402
from helpers.torch_samplers import DecodeLoop, eager_sampler  # noqa: E402

from trace_replay_core import greedy_argmax_reference  # noqa: E402
from trace_replay_torch import (  # noqa: E402
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    TraceReplayState,
    replay_op,
    token_logprob_rank,
    token_logprob_rank_op,
)

POISON_ARGMAX = -777
OPS = torch.ops.trace_replay


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _logits(x: np.ndarray, dtype: str):
    return torch.from_numpy(x).to(TORCH_DTYPES[dtype])


def _bits(t) -> np.ndarray:
    return t.numpy().view(np.uint32)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("batch,vocab", [(1, 1), (1, 1000), (11, 7), (23, 1000), (100, 32000)])
def test_argmax_and_greedy_rows_match_the_references(dtype, batch, vocab):
    rng = np.random.default_rng(batch * 131 + vocab)
    x, ids = greedy_case(rng, batch, vocab, dtype)
    logits, ids_t = _logits(x, dtype), torch.from_numpy(ids)
    got = token_logprob_rank(logits, ids_t, argmax=True)
    assert type(got) is LogprobRankArgmax and got._fields == ("logprobs", "ranks", "argmax")
    assert (got.logprobs.dtype, got.ranks.dtype, got.argmax.dtype) == (torch.float32, torch.int64, torch.int64)
    assert ids_t.tolist() == ids.tolist(), "token_ids must not be written"
    # planted: greedy row 1's maximum repeated, the special rows explicit and greedy.
    assert_greedy(x, ids, *got, f"{batch}x{vocab} {dtype}", planted=True)
    no_nan = ~np.isnan(x).any(axis=1)  # torch.argmax's choice wherever no NaN interferes
    assert torch.equal(got.argmax[torch.from_numpy(no_nan)], logits.argmax(dim=-1)[torch.from_numpy(no_nan)])
    # A greedy row has the bits of a call that names its argmax; explicit rows are unchanged by argmax=True.
    explicit = torch.where(ids_t < 0, got.argmax, ids_t)
    plain = token_logprob_rank(logits, explicit)
    assert type(plain) is LogprobRank
    assert np.array_equal(_bits(got.logprobs), _bits(plain.logprobs)) and torch.equal(got.ranks, plain.ranks)
    again = token_logprob_rank(logits, explicit, argmax=True)
    assert np.array_equal(_bits(again.logprobs), _bits(plain.logprobs)) and torch.equal(again.argmax, got.argmax)
    # Without argmax a negative id stays invalid.
    if (ids < 0).any():
        invalid = token_logprob_rank(logits, ids_t)
        assert torch.isnan(invalid.logprobs[ids_t < 0]).all() and (invalid.ranks[ids_t < 0] == -1).all()


def test_hand_computed_ties_and_special_rows():
    x = np.array(
        [
            [1.0, 3.0, 3.0, 2.0],  # tie at the maximum: the lower id, rank 2
            [-np.inf, -np.inf, -np.inf, -np.inf],  # all -inf: 0, logprob NaN, rank 4
            [np.nan, np.nan, np.nan, np.nan],  # all NaN: 0, logprob NaN, rank 0
            [np.nan, 2.0, 5.0, 5.0],  # NaN skipped: 2
            [4.0, 3.0, 2.0, 1.0],
        ],
        dtype=np.float32,
    )
    ids = torch.tensor([-1, -1, -1, -1, 3])
    got = token_logprob_rank(torch.from_numpy(x), ids, argmax=True)
    assert got.argmax.tolist() == [1, 0, 0, 2, 0]
    assert got.ranks.tolist() == [2, 4, 0, 2, 4]
    lse0 = np.log(np.exp(1.0) + 2 * np.exp(3.0) + np.exp(2.0))
    assert abs(float(got.logprobs[0]) - (3.0 - lse0)) < 2e-6
    assert torch.isnan(got.logprobs[1:4]).all()
    assert abs(float(got.logprobs[4]) - (1.0 - np.log(np.exp([4.0, 3.0, 2.0, 1.0]).sum()))) < 2e-6


@pytest.mark.parametrize("top_k", [1, 5])
def test_argmax_with_top_k_and_temperature(top_k):
    rng = np.random.default_rng(17 + top_k)
    x, ids = greedy_case(rng, 12, 500, "bfloat16")
    logits, ids_t = _logits(x, "bfloat16"), torch.from_numpy(ids)
    temp = torch.from_numpy(rng.uniform(0.3, 2.0, 12).astype(np.float32))
    for temperature in (None, 0.7, temp):
        got = token_logprob_rank(logits, ids_t, top_k=top_k, temperature=temperature, argmax=True)
        assert type(got) is LogprobRankTopKArgmax
        assert got._fields == ("logprobs", "ranks", "topk_logprobs", "topk_ids", "argmax")
        t = (
            np.ones(12, np.float32)
            if temperature is None
            else (np.full(12, 0.7, np.float32) if isinstance(temperature, float) else temp.numpy())
        )
        y = x / t[:, None]  # float32, as the backend divides
        want = greedy_argmax_reference(y)
        assert got.argmax.numpy().tolist() == want.tolist(), f"argmax of logits / T ({temperature!r})"
        explicit = torch.where(ids_t < 0, got.argmax, ids_t)
        plain = token_logprob_rank(logits, explicit, top_k=top_k, temperature=temperature)
        assert type(plain) is LogprobRankTopK
        for a, b in zip(got[:4], plain):
            assert np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8)), "argmax changed a bit"
        has_value = ~np.isnan(y).all(axis=1)
        assert torch.equal(got.topk_ids[:, 0][torch.from_numpy(has_value)], got.argmax[torch.from_numpy(has_value)]), (
            "top-1 and argmax disagree"
        )


@pytest.mark.parametrize("rank_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_out_with_three_and_five_tensors(rank_dtype, ids_dtype):
    rng = np.random.default_rng(5)
    x, ids = greedy_case(rng, 13, 300, "float16")
    logits, ids_t = _logits(x, "float16"), torch.from_numpy(ids).to(ids_dtype)
    want = token_logprob_rank(logits, ids_t, top_k=4, argmax=True)

    def poisoned(top_k):
        outs = [torch.full((13,), POISON_LOGPROB), torch.full((13,), POISON_RANK, dtype=rank_dtype)]
        if top_k:
            outs += [torch.full((13, top_k), POISON_LOGPROB), torch.full((13, top_k), POISON_RANK, dtype=rank_dtype)]
        return tuple(outs + [torch.full((13,), POISON_ARGMAX, dtype=rank_dtype)])

    three = poisoned(0)
    got = token_logprob_rank(logits, ids_t, argmax=True, out=three)
    assert type(got) is LogprobRankArgmax and all(g is o for g, o in zip(got, three))
    five = poisoned(4)
    got5 = token_logprob_rank(logits, ids_t, top_k=4, argmax=True, out=list(five))
    assert type(got5) is LogprobRankTopKArgmax and all(g is o for g, o in zip(got5, five))
    for res in (got, got5):
        assert np.array_equal(_bits(res.logprobs), _bits(want.logprobs))
        assert res.ranks.tolist() == want.ranks.tolist() and res.argmax.tolist() == want.argmax.tolist()
    assert got5.topk_ids.tolist() == want.topk_ids.tolist()
    # The one-pass greedy step with caller buffers of the ids' dtype, in place and allocation-free.
    sampled = ids_t.clone()
    am = torch.empty(13, dtype=ids_dtype)
    greedy = torch.empty(13, dtype=torch.bool)
    token_logprob_rank(logits, sampled, argmax=True, out=(three[0], three[1], am))
    torch.lt(sampled, 0, out=greedy)
    torch.where(greedy, am, sampled, out=sampled)
    assert sampled.tolist() == torch.where(ids_t < 0, want.argmax, ids_t.long()).tolist()


def _refusals():
    lg = torch.randn(5, 40)
    ids = torch.tensor([1, -1, 3, -1, 0])
    lp, rk = torch.full((5,), POISON_LOGPROB), torch.full((5,), POISON_RANK, dtype=torch.int64)

    def poison(*shape, dtype=torch.int64):
        return torch.full(shape, POISON_ARGMAX, dtype=dtype)

    shared = torch.zeros(8, dtype=torch.int64)
    return (
        {
            "argmax-int": (dict(argmax=1), TypeError, r"^argmax must be a bool \(got int 1\)$"),
            "argmax-none": (dict(argmax=None), TypeError, r"^argmax must be a bool \(got NoneType None\)$"),
            "argmax-str": (dict(argmax="yes"), TypeError, r"^argmax must be a bool \(got str 'yes'\)$"),
            "argmax-tensor": (dict(argmax=torch.tensor(True)), TypeError, r"^argmax must be a bool \(got Tensor "),
            "out-two-with-argmax": (
                dict(argmax=True, out=(lp, rk)),
                TypeError,
                r"^out must be a \(logprobs, ranks, argmax\) tuple of torch\.Tensor with top_k=0, "
                r"argmax=True \(got \['Tensor', 'Tensor'\]\)$",
            ),
            "out-three-without-argmax": (
                dict(out=(lp, rk, poison(5))),
                TypeError,
                r"^out must be a \(logprobs, ranks\) tuple of torch\.Tensor with top_k=0, "
                r"argmax=False",
            ),
            "out-four-with-top-k-and-argmax": (
                dict(argmax=True, top_k=2, out=(lp, rk, poison(5, 2, dtype=torch.float32), poison(5, 2))),
                TypeError,
                r"^out must be a \(logprobs, ranks, topk_logprobs, "
                r"topk_ids, argmax\) tuple",
            ),
            "argmax-out-float": (
                dict(argmax=True, out=(lp, rk, poison(5, dtype=torch.float32))),
                TypeError,
                r"^out_argmax must have dtype int32 or int64 \(got float32\)$",
            ),
            "argmax-out-int16": (
                dict(argmax=True, out=(lp, rk, poison(5, dtype=torch.int16))),
                TypeError,
                r"^out_argmax must have dtype int32 or int64 \(got int16\)$",
            ),
            "argmax-out-short": (
                dict(argmax=True, out=(lp, rk, poison(4))),
                ValueError,
                r"^out_argmax must have 5 rows \(got shape \[4\]\)$",
            ),
            "argmax-out-2d": (
                dict(argmax=True, out=(lp, rk, poison(5, 1))),
                ValueError,
                r"^out_argmax must be 1-D \(got shape \[5, 1\]\)$",
            ),
            "argmax-out-strided": (
                dict(argmax=True, out=(lp, rk, poison(10)[::2])),
                ValueError,
                r"^out_argmax must be contiguous",
            ),
            "argmax-out-is-token-ids": (
                dict(token_ids=shared[:5], argmax=True, out=(lp, rk, shared[3:8])),
                ValueError,
                r"^out_argmax and token_ids overlap in memory",
            ),
            "argmax-out-is-ranks": (
                dict(argmax=True, out=(lp, rk, rk)),
                ValueError,
                r"^out_ranks and out_argmax overlap in memory",
            ),
        },
        lg,
        ids,
    )


REFUSALS, _, _ = _refusals()


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_argument_and_write_nothing(case):
    cases, logits, ids = _refusals()
    kwargs, exc, pattern = cases[case]
    token_ids = kwargs.pop("token_ids", ids)
    out = kwargs.get("out")
    before = [t.clone() for t in out] if out is not None else []
    ids_before = token_ids.clone()
    with pytest.raises(exc, match=pattern):
        token_logprob_rank(logits, token_ids, **kwargs)
    for a, b in zip(before, out or ()):
        assert np.array_equal(a.contiguous().numpy().view(np.uint8), b.contiguous().numpy().view(np.uint8)), (
            "a refused call wrote an output"
        )
    assert torch.equal(token_ids, ids_before)
    if case.startswith("argmax-") and not case.startswith("argmax-out"):
        with pytest.raises(exc, match=pattern):
            token_logprob_rank_op(logits, token_ids, argmax=kwargs["argmax"])


def test_bound_call_cache_keys_on_the_argmax_tensor():
    """The adapter's bound-call cache (the CUDA path; exercised here through the numpy backend)
    binds argmax with the other tensors: a layout with argmax, one without and one with another
    argmax tensor are three bound calls, and each writes what its own tensors say."""
    from trace_replay_torch.logprob import _bound

    x, ids = greedy_case(np.random.default_rng(9), 6, 200, "float32")
    logits, ids_t = torch.from_numpy(x), torch.from_numpy(ids)
    lp, rk = torch.full((6,), POISON_LOGPROB), torch.full((6,), POISON_RANK, dtype=torch.int64)
    ws = torch.empty(16, dtype=torch.uint8)
    am1, am2 = (torch.full((6,), POISON_ARGMAX, dtype=dt) for dt in (torch.int64, torch.int32))
    with_1 = _bound((logits, ids_t, lp, rk, ws, None, None, None, am1, None), 0, 0)
    without = _bound((logits, ids_t, lp, rk, ws, None, None, None, None, None), 0, 0)
    with_2 = _bound((logits, ids_t, lp, rk, ws, None, None, None, am2, None), 0, 0)
    assert len({id(with_1), id(without), id(with_2)}) == 3
    assert _bound((logits, ids_t, lp, rk, ws, None, None, None, am1, None), 0, 0) is with_1
    want = greedy_argmax_reference(x)
    without(stream=0)
    assert (am1 == POISON_ARGMAX).all() and (am2 == POISON_ARGMAX).all()
    assert (rk[ids_t < 0] == -1).all()  # no argmax: greedy rows are out of range
    with_1(stream=0)
    assert am1.tolist() == want.tolist() and (am2 == POISON_ARGMAX).all()
    assert_matches_reference(x, np.where(ids < 0, want, ids), lp.numpy(), rk.numpy(), "bound with argmax")
    with_2(stream=0)
    assert am2.tolist() == want.tolist()


def _one_pass_step(state, logits, idx_mapping):
    """The greedy step of the decode loops: -1, replay, score with argmax, fill the greedy rows."""
    sampled = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    state.replay(sampled, idx_mapping)
    logprobs, ranks, argmax = token_logprob_rank(logits, sampled, argmax=True)
    return torch.where(sampled < 0, argmax, sampled), logprobs, ranks, argmax


def _op_step(state, logits, idx_mapping):
    """The same step through the registered ops (what ``torch.compile`` traces)."""
    sampled = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    replay_op(state, sampled, idx_mapping)
    logprobs, ranks, argmax = token_logprob_rank_op(logits, sampled, argmax=True)
    return torch.where(sampled < 0, argmax, sampled), logprobs, ranks, argmax


def test_one_pass_greedy_step_equals_argmax_replay_score(rng):
    """Over steps with requests admitted between them: the one-pass step (eager and compiled
    through the ops, ``fullgraph=True``) gives the tokens, logprob bits and ranks of the two-pass
    step (``torch.argmax``, replay, score), and its argmax is ``torch.argmax``'s."""
    slots, batch, vocab = 16, 12, 97
    total = torch.zeros(slots, dtype=torch.int32)
    prompt = torch.zeros(slots, dtype=torch.int32)
    with TraceReplayState(slots, 24, device="cpu", total_len=total, prompt_len=prompt) as st:
        loop = DecodeLoop(rng, st, total, prompt, batch=batch, vocab=vocab)
        compiled = torch.compile(_op_step, fullgraph=True, dynamic=False, backend="eager")
        for step in range(10):
            loop.admit_and_commit()
            logits, idx = loop.step_inputs()
            want_tokens, want_lp, want_rk = eager_sampler(st, logits, idx)
            expected = loop.expected(torch.argmax(logits, dim=-1), idx)
            for name, fn in (("eager", _one_pass_step), ("compiled", compiled)):
                tokens, lp, rk, am = fn(st, logits, idx)
                assert_tokens_equal(tokens.numpy(), expected, f"{name}, step {step}")
                assert torch.equal(tokens, want_tokens) and torch.equal(rk, want_rk), f"{name}, step {step}"
                assert np.array_equal(_bits(lp), _bits(want_lp)), f"{name} logprob bits, step {step}"
                assert torch.equal(am, torch.argmax(logits, dim=-1)), f"{name} argmax, step {step}"
            loop.advance()
        assert loop.forced > 5


@pytest.mark.parametrize("top_k", [0, 3])
def test_opcheck_argmax_ops(top_k):
    rng = np.random.default_rng(2)  # ties on a grid of 0.5; no NaN (opcheck compares outputs)
    x = (np.round(rng.standard_normal((9, 64)) * 2.0) / 2.0).astype(np.float32)
    ids = rng.integers(0, 64, 9)
    ids[1::2] = -1
    logits, ids_t = torch.from_numpy(x), torch.from_numpy(ids)
    temp = torch.full((9,), 0.8)
    if top_k:
        torch.library.opcheck(OPS.token_logprob_rank_topk_argmax.default, (logits, ids_t, top_k))
        torch.library.opcheck(OPS.token_logprob_rank_topk_argmax.default, (logits, ids_t, top_k, temp))
    else:
        torch.library.opcheck(OPS.token_logprob_rank_argmax.default, (logits, ids_t))
        torch.library.opcheck(OPS.token_logprob_rank_argmax.default, (logits, ids_t[:, None], temp))
    got = token_logprob_rank_op(logits, ids_t, top_k=top_k, temperature=0.8, argmax=True)
    want = token_logprob_rank(logits, ids_t, top_k=top_k, temperature=0.8, argmax=True)
    assert type(got) is type(want) is (LogprobRankTopKArgmax if top_k else LogprobRankArgmax)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g.numpy().view(np.uint8), w.numpy().view(np.uint8))
