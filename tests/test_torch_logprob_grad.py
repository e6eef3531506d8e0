"""Gradients of trace_replay_torch's logprob op on the CPU backend: autograd against float64
``torch.log_softmax`` autograd, ``gradcheck``, ``opcheck`` of the ops and of the backward op,
``torch.func.grad``/``jacrev``/``vmap``, ``torch.compile`` (aot_eager), and the no-grad path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.backward_cases import assert_grads, make_backward_case
from helpers.logprob_cases import TORCH_DTYPES

from trace_replay_torch import token_logprob_rank, token_logprob_rank_op

# name -> (options of make_backward_case, call flags)
CASES = {
    "logprob": ({}, {}),
    "temp-grad": (dict(temp=True, grad_t=True), {}),
    "topk": (dict(top_k=3), dict(top_k=3)),
    "entropy": (dict(entropy=True), dict(entropy=True)),
    "all-greedy-rows": (
        dict(temp=True, grad_t=True, top_k=2, entropy=True, argmax=True, invalid_rows=(1,)),
        dict(top_k=2, entropy=True, argmax=True),
    ),
}


def _loss_and_grads(fn, case, flags, dtype):
    """Run ``fn`` with grad on the case's logits (and temperature), weight its float outputs with
    the case's upstream gradients, backward; returns (grad of logits as float32 numpy, grad of T)."""
    logits = torch.from_numpy(case["x"]).to(TORCH_DTYPES[dtype]).requires_grad_(True)
    temp = None
    if case.get("temp") is not None:
        temp = torch.from_numpy(case["temp"]).requires_grad_(bool(case.get("grad_t")))
    res = fn(logits, torch.from_numpy(case["ids"]), temperature=temp, **flags)
    assert res.logprobs.grad_fn is not None and not res.ranks.requires_grad
    loss = (res.logprobs * torch.from_numpy(case["g"])).sum()
    if flags.get("top_k"):
        loss = loss + (res.topk_logprobs * torch.from_numpy(case["gk"])).sum()
    if flags.get("entropy"):
        loss = loss + (res.entropy * torch.from_numpy(case["ge"])).sum()
    # rows whose id is out of range have a NaN logprob: masked as a trainer masks padding
    loss.backward()
    return logits.grad.float().numpy(), (temp.grad.numpy() if temp is not None and temp.grad is not None else None)


def _masked_case(case):
    """The case with its upstream gradient 0 where the logprob is NaN (padding rows, masked)."""
    case["g"] = np.where(np.isnan(case["lp"]), np.float32(0), case["g"]).astype(np.float32)
    return case


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("fn", [token_logprob_rank, token_logprob_rank_op], ids=["eager", "op"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_autograd_matches_log_softmax(rng, name, fn, dtype):
    options, flags = CASES[name]
    case = _masked_case(make_backward_case(rng, 6, 131, dtype, **options))
    grad, grad_t = _loss_and_grads(fn, case, flags, dtype)
    assert_grads(case, grad, grad_t, f"torch {name} {dtype}")


def test_gradcheck_float32():
    """gradcheck with float32 logits (the op takes no float64): finite differences of step 1e-2
    against the analytical gradient, logits and temperature."""
    gen = torch.Generator().manual_seed(0)  # fixed inputs, torch's global generator untouched
    x = (torch.randn(3, 17, generator=gen) * 2).requires_grad_(True)
    t = (torch.rand(3, generator=gen) + 0.5).requires_grad_(True)
    ids = torch.tensor([0, 5, 16])

    def f(x, t):
        r = token_logprob_rank(x, ids, top_k=2, temperature=t, entropy=True)
        return r.logprobs, r.topk_logprobs, r.entropy

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(f, (x, t), eps=1e-2, atol=2e-3, rtol=2e-2)


def test_no_grad_path_is_direct():
    x, ids = torch.randn(3, 40), torch.tensor([1, 2, 3])
    assert token_logprob_rank(x, ids).logprobs.grad_fn is None
    x.requires_grad_(True)
    with torch.no_grad():
        assert token_logprob_rank(x, ids).logprobs.grad_fn is None
    out = (torch.empty(3), torch.empty(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"^out= cannot be used when logits or temperature require grad"):
        token_logprob_rank(x, ids, out=out)


def _reference_logprobs(x, ids):
    return torch.log_softmax(x, -1)[torch.arange(x.shape[-2]), ids]


def test_func_transforms():
    gen = torch.Generator().manual_seed(1)
    x, ids = torch.randn(4, 60, generator=gen), torch.randint(0, 60, (4,), generator=gen)
    xb = torch.randn(3, 4, 60, generator=gen)

    def ours(a):
        return token_logprob_rank(a, ids).logprobs

    def ref(a):
        return _reference_logprobs(a, ids)

    torch.testing.assert_close(
        torch.func.grad(lambda a: ours(a).sum())(x), torch.func.grad(lambda a: ref(a).sum())(x), atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(torch.func.jacrev(ours)(x), torch.func.jacrev(ref)(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.vmap(ours)(xb), torch.vmap(ref)(xb), atol=2e-6, rtol=1e-5)
    grads = torch.vmap(torch.func.grad(lambda a: ours(a).sum()))(xb)
    torch.testing.assert_close(grads, torch.vmap(torch.func.grad(lambda a: ref(a).sum()))(xb), atol=1e-6, rtol=1e-5)
    # a mapped token axis and top-k: every output gains the mapped axis in front
    idsb = torch.randint(0, 60, (3, 4))
    res = torch.vmap(lambda a, i: token_logprob_rank(a, i, top_k=2, entropy=True, argmax=True))(xb, idsb)
    assert res.topk_ids.shape == (3, 4, 2) and res.entropy.shape == (3, 4) and res.argmax.shape == (3, 4)
    torch.testing.assert_close(res.logprobs, torch.log_softmax(xb, -1).gather(2, idsb[..., None])[..., 0])


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_opcheck_every_logprob_op(top_k, argmax, entropy):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 33, generator=gen, requires_grad=True)
    # a greedy row with argmax (its id -1); opcheck compares outputs without equating NaN
    ids, t = torch.tensor([0, -1 if argmax else 7, 32]), (torch.rand(3, generator=gen) + 0.5).requires_grad_(True)
    name = "token_logprob_rank" + ("_topk" if top_k else "") + ("_argmax" if argmax else "")
    op = getattr(torch.ops.trace_replay, name + ("_entropy" if entropy else "")).default
    for temp in (t, None):
        torch.library.opcheck(op, (x, ids, top_k, temp) if top_k else (x, ids, temp))


def test_opcheck_backward():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 33, generator=gen, requires_grad=True)
    ids, t = torch.tensor([0, 7, 32]), (torch.rand(3, generator=gen) + 0.5).requires_grad_(True)
    ops = torch.ops.trace_replay
    lp, _, tlp, tid, am, ent = ops.token_logprob_rank_topk_argmax_entropy(x.detach(), ids, 3, t.detach())
    g, g_topk, g_ent = torch.randn(3, generator=gen), torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen)
    args = (x.detach(), ids, t.detach(), am, lp, g, tid, tlp, g_topk, ent, g_ent, True)
    torch.library.opcheck(ops.token_logprob_rank_backward.default, args)


def test_compile_backward_aot_eager():
    gen = torch.Generator().manual_seed(3)
    x, ids = torch.randn(5, 70, generator=gen, requires_grad=True), torch.randint(0, 70, (5,), generator=gen)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(a):
        r = token_logprob_rank_op(a, ids, entropy=True)
        return r.logprobs.sum() + 0.5 * r.entropy.sum()

    loss(x).backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ls = torch.log_softmax(ref_x, -1)
    (ls[torch.arange(5), ids].sum() - 0.5 * (ls.exp() * ls).sum()).backward()
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-6, rtol=1e-5)
