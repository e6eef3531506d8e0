"""CPU tier: ``trace_replay_torch.token_logprob_rank(..., entropy=True)`` and the ``_entropy`` ops.

Each row's entropy comes from the same read of the logits as its logprob. Checked on CPU tensors
(the numpy backend, the same adapter code as on the GPU up to the launch) against the float64
reference of ``helpers/entropy_cases.py`` and ``torch.distributions.Categorical``: the eight
result types and their fields, ``out=`` with the entropy tensor last (poisoned beforehand),
temperature, top-k and argmax at once, refusals that write nothing, the bound-call cache keyed on
the entropy tensor, the registered ops (``opcheck``) and a compiled sampler (``fullgraph=True``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.entropy_cases import assert_entropy, entropy_case  # noqa: E402
from helpers.logprob_cases import POISON_LOGPROB, POISON_RANK, TORCH_DTYPES, assert_matches_reference  # noqa: E402

from trace_replay_core import greedy_argmax_reference  # noqa: E402
from trace_replay_torch import (  # noqa: E402
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    token_logprob_rank,
    token_logprob_rank_op,
)

OPS = torch.ops.trace_replay
RESULTS = {
    (False, False, False): LogprobRank,
    (True, False, False): LogprobRankTopK,
    (False, True, False): LogprobRankArgmax,
    (True, True, False): LogprobRankTopKArgmax,
    (False, False, True): LogprobRankEntropy,
    (True, False, True): LogprobRankTopKEntropy,
    (False, True, True): LogprobRankArgmaxEntropy,
    (True, True, True): LogprobRankTopKArgmaxEntropy,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _bits(t) -> bytes:
    return t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("batch,vocab", [(1, 1), (9, 7), (23, 1000), (12, 32000)])
def test_entropy_matches_the_reference_and_torch(dtype, batch, vocab):
    rng = np.random.default_rng(batch * 131 + vocab)
    x, ids = entropy_case(rng, batch, vocab, dtype)
    logits, ids_t = torch.from_numpy(x).to(TORCH_DTYPES[dtype]), torch.from_numpy(ids)
    got = token_logprob_rank(logits, ids_t, entropy=True)
    assert type(got) is LogprobRankEntropy and got._fields == ("logprobs", "ranks", "entropy")
    assert got.entropy.dtype == torch.float32 and got.entropy.shape == (batch,)
    assert_entropy(x, got.entropy.numpy(), f"torch {batch}x{vocab} {dtype}", planted=True)
    finite = torch.from_numpy(np.isfinite(x).any(axis=1) & ~np.isnan(x).any(axis=1) & ~np.isposinf(x).any(axis=1))
    want = torch.distributions.Categorical(logits=logits.float()[finite]).entropy()
    torch.testing.assert_close(got.entropy[finite], want, rtol=2e-5, atol=2e-6)
    plain = token_logprob_rank(logits, ids_t)  # entropy changes no bit of the logprobs and ranks
    assert _bits(plain.logprobs) == _bits(got.logprobs) and torch.equal(plain.ranks, got.ranks)


@pytest.mark.parametrize("top_k,argmax,entropy", list(itertools.product((0, 3), (False, True), (False, True))))
def test_every_combination_names_its_fields(top_k, argmax, entropy):
    x, ids = entropy_case(np.random.default_rng(2), 9, 50, "float32")
    ids[1::2] = -1
    logits, ids_t = torch.from_numpy(x), torch.from_numpy(ids)
    temp = torch.from_numpy(np.random.default_rng(3).uniform(0.5, 2.0, 9).astype(np.float32))
    got = token_logprob_rank(logits, ids_t, top_k=top_k, temperature=temp, argmax=argmax, entropy=entropy)
    cls = RESULTS[(top_k > 0, argmax, entropy)]
    assert type(got) is cls
    fields = ("logprobs", "ranks") + (("topk_logprobs", "topk_ids") if top_k else ())
    fields += (("argmax",) if argmax else ()) + (("entropy",) if entropy else ())
    assert got._fields == fields
    y = x / temp.numpy()[:, None]
    if entropy:
        assert_entropy(y, got.entropy.numpy(), f"torch k={top_k} argmax={argmax}")
    if argmax:
        want = greedy_argmax_reference(y)
        assert got.argmax.tolist() == want.tolist()
        assert_matches_reference(y, np.where(ids < 0, want, ids), got.logprobs.numpy(), got.ranks.numpy(), "greedy")
    op = token_logprob_rank_op(logits, ids_t, top_k=top_k, temperature=temp, argmax=argmax, entropy=entropy)
    assert type(op) is cls
    for a, b in zip(got, op, strict=True):
        assert a.dtype == b.dtype and _bits(a) == _bits(b)


@pytest.mark.parametrize("top_k,argmax", [(0, False), (4, False), (0, True), (4, True)])
def test_out_with_the_entropy_tensor_last(top_k, argmax):
    rng = np.random.default_rng(5)
    x, ids = entropy_case(rng, 13, 300, "bfloat16")
    logits, ids_t = torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids).to(torch.int32)
    want = token_logprob_rank(logits, ids_t, top_k=top_k, argmax=argmax, entropy=True)
    outs = [torch.full((13,), POISON_LOGPROB), torch.full((13,), POISON_RANK, dtype=torch.int32)]
    if top_k:
        outs += [torch.full((13, top_k), POISON_LOGPROB), torch.full((13, top_k), POISON_RANK, dtype=torch.int32)]
    if argmax:
        outs.append(torch.full((13,), -777, dtype=torch.int32))
    outs.append(torch.full((13,), float("nan")))
    got = token_logprob_rank(logits, ids_t, top_k=top_k, argmax=argmax, entropy=True, out=tuple(outs))
    assert type(got) is type(want) and all(g is o for g, o in zip(got, outs, strict=True))
    assert _bits(got.entropy) == _bits(want.entropy) and _bits(got.logprobs) == _bits(want.logprobs)
    assert_entropy(x, got.entropy.numpy(), "out=", planted=True)


def _refusals():
    lg = torch.randn(5, 40)
    lp, rk = torch.full((5,), POISON_LOGPROB), torch.full((5,), POISON_RANK, dtype=torch.int64)

    def poison(*shape, dtype=torch.float32):
        return torch.full(shape, float("nan")) if dtype.is_floating_point else torch.full(shape, -777, dtype=dtype)

    return {
        "entropy-int": (dict(entropy=1), TypeError, r"^entropy must be a bool \(got int 1\)$"),
        "entropy-none": (dict(entropy=None), TypeError, r"^entropy must be a bool \(got NoneType None\)$"),
        "entropy-tensor": (dict(entropy=torch.tensor(True)), TypeError, r"^entropy must be a bool \(got Tensor "),
        "out-two-with-entropy": (
            dict(entropy=True, out=(lp, rk)),
            TypeError,
            r"^out must be a \(logprobs, ranks, entropy\) tuple of torch\.Tensor with top_k=0, argmax=False, "
            r"entropy=True \(got \['Tensor', 'Tensor'\]\)$",
        ),
        "out-three-argmax-entropy": (
            dict(entropy=True, argmax=True, out=(lp, rk, poison(5))),
            TypeError,
            r"^out must be a \(logprobs, ranks, argmax, entropy\) tuple",
        ),
        "entropy-out-int": (
            dict(entropy=True, out=(lp, rk, poison(5, dtype=torch.int64))),
            TypeError,
            r"^out_entropy must have dtype float32 \(got int64\)$",
        ),
        "entropy-out-float64": (
            dict(entropy=True, out=(lp, rk, torch.zeros(5, dtype=torch.float64))),
            TypeError,
            r"^out_entropy must have dtype float32 \(got float64\)$",
        ),
        "entropy-out-short": (
            dict(entropy=True, out=(lp, rk, poison(4))),
            ValueError,
            r"^out_entropy must have 5 rows \(got shape \[4\]\)$",
        ),
        "entropy-out-is-logprobs": (
            dict(entropy=True, out=(lp, rk, lp)),
            ValueError,
            r"^out_logprobs and out_entropy overlap in memory",
        ),
    }, lg


@pytest.mark.parametrize("case", sorted(_refusals()[0]))
def test_refusals_name_the_argument_and_write_nothing(case):
    cases, logits = _refusals()
    kwargs, exc, pattern = cases[case]
    ids = torch.tensor([1, 2, 3, 4, 0])
    out = kwargs.get("out")
    before = [t.clone() for t in out] if out is not None else []
    with pytest.raises(exc, match=pattern):
        token_logprob_rank(logits, ids, **kwargs)
    for a, b in zip(before, out or ()):
        assert _bits(a) == _bits(b), "a refused call wrote an output"
    if case.startswith("entropy-") and not case.startswith("entropy-out"):
        with pytest.raises(exc, match=pattern):
            token_logprob_rank_op(logits, ids, entropy=kwargs["entropy"])


def test_bound_call_cache_keys_on_the_entropy_tensor():
    """The adapter's bound-call cache (the CUDA path; exercised here through the numpy backend)
    binds the entropy tensor with the others: with it, without it and with another one are three
    bound calls, and each writes only its own tensors."""
    from trace_replay_torch.logprob import _bound

    x, ids = entropy_case(np.random.default_rng(9), 9, 200, "float32")
    logits, ids_t = torch.from_numpy(x), torch.from_numpy(ids)
    lp, rk = torch.full((9,), POISON_LOGPROB), torch.full((9,), POISON_RANK, dtype=torch.int64)
    ws = torch.empty(16, dtype=torch.uint8)
    e1, e2 = torch.full((9,), float("nan")), torch.full((9,), float("nan"))
    with_1 = _bound((logits, ids_t, lp, rk, ws, None, None, None, None, e1), 0, 0)
    without = _bound((logits, ids_t, lp, rk, ws, None, None, None, None, None), 0, 0)
    with_2 = _bound((logits, ids_t, lp, rk, ws, None, None, None, None, e2), 0, 0)
    assert len({id(with_1), id(without), id(with_2)}) == 3
    assert _bound((logits, ids_t, lp, rk, ws, None, None, None, None, e1), 0, 0) is with_1
    without(stream=0)
    assert torch.isnan(e1).all() and torch.isnan(e2).all()
    with_1(stream=0)
    assert_entropy(x, e1.numpy(), "bound with entropy", planted=True)
    assert torch.isnan(e2).all()
    with_2(stream=0)
    assert _bits(e2) == _bits(e1)


@pytest.mark.parametrize("top_k,argmax", [(0, False), (3, False), (0, True), (3, True)])
def test_opcheck_entropy_ops(top_k, argmax):
    rng = np.random.default_rng(2)  # no NaN in or out (opcheck compares outputs)
    x = (np.round(rng.standard_normal((9, 64)) * 2.0) / 2.0).astype(np.float32)
    ids = rng.integers(0, 64, 9)
    if argmax:
        ids[1::2] = -1
    logits, ids_t, temp = torch.from_numpy(x), torch.from_numpy(ids), torch.full((9,), 0.8)
    name = "token_logprob_rank" + ("_topk" if top_k else "") + ("_argmax" if argmax else "") + "_entropy"
    op = getattr(OPS, name).default
    args = (logits, ids_t, top_k) if top_k else (logits, ids_t)
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, args + (temp,))


def test_compiled_sampler_with_entropy_equals_eager():
    """A sampler that scores its draw and reports each row's entropy, compiled through the ops
    (``fullgraph=True``): the bits of the eager adapter call."""

    def sampler(logits, temperature):
        sampled = torch.argmax(logits, dim=-1)
        logprobs, ranks, entropy = token_logprob_rank_op(logits, sampled, temperature=temperature, entropy=True)
        return sampled, logprobs, ranks, entropy

    compiled = torch.compile(sampler, fullgraph=True, dynamic=False, backend="eager")
    rng = np.random.default_rng(11)
    for step in range(3):
        x, _ = entropy_case(rng, 10, 97, "float32")
        x[np.isnan(x) | np.isposinf(x)] = 1.0  # argmax samplers draw from finite rows
        logits, temp = torch.from_numpy(x), torch.full((10,), 0.7)
        sampled, lp, rk, ent = compiled(logits, temp)
        want = token_logprob_rank(logits, sampled, temperature=0.7, entropy=True)
        assert _bits(ent) == _bits(want.entropy) and _bits(lp) == _bits(want.logprobs), step
        assert torch.equal(rk, want.ranks) and torch.equal(sampled, logits.argmax(-1)), step
        assert_entropy(x / np.float32(0.7), ent.numpy(), f"compiled step {step}")
