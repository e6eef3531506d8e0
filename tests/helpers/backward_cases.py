"""The logprob backward's test data, reference and tolerance (``test_logprob_backward.py``, the
adapters' gradient tests and ``test_gpu_logprob_backward.py`` share them).

The reference is float64 ``torch.log_softmax`` autograd (no code shared with the library): ``L =
sum g * logprob[token] + sum gk * logprob[top-k ids] + sum ge * entropy`` of ``log_softmax(x /
T)``, differentiated with respect to ``x`` and ``T``. Rows whose id is out of range add nothing
(their logprob is a constant NaN).

Tolerance by the gradient's dtype: float32 arithmetic (``p`` from the recovered ``lse`` to a
relative ``1e-6`` at these logit sizes) and the rounding to the logits' dtype (one unit in the
last place: 2**-7 relative for bfloat16, 2**-10 for float16); the temperature gradient is a sum
over the vocabulary of terms up to ``|log p| * p``, float32 too.
"""

from __future__ import annotations

import numpy as np
import torch

from trace_replay_core import token_logprob_rank

from .logprob_cases import round_to

# one unit in the last place of the dtype: the GPU rounds to nearest (half a unit), Triton's
# interpreter truncates float32 to bfloat16
RTOL = {"float32": 2e-5, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def make_backward_case(
    rng, batch: int, vocab: int, dtype: str = "float32", *, temp=False, top_k=0, entropy=False, argmax=False,
    grads=("g", "gk", "ge"), grad_t=False, invalid_rows=(), name="case",
):  # fmt: skip
    """Random non-zero logits exact in ``dtype``, ids (negative in ``invalid_rows``), the forward's
    outputs from the numpy backend, random upstream gradients; a dict for the interpreter driver."""
    x = round_to((rng.standard_normal((batch, vocab)) * 3).astype(np.float32), dtype)
    x[x == 0] = 0.5
    ids = rng.integers(0, vocab, batch).astype(np.int64)
    ids[list(invalid_rows)] = -1
    t = rng.uniform(0.5, 2.0, batch).astype(np.float32) if temp else None
    case = dict(name=name, x=x, ids=ids, dtype=dtype, temp=t, grad_t=bool(grad_t and temp))
    forward(case, top_k=top_k, entropy=entropy, argmax=argmax)
    if "g" in grads:
        case["g"] = rng.standard_normal(batch).astype(np.float32)
    if top_k and "gk" in grads:
        case["gk"] = rng.standard_normal((batch, top_k)).astype(np.float32)
    if entropy and "ge" in grads:
        case["ge"] = rng.standard_normal(batch).astype(np.float32)
    return case


def forward(case: dict, *, top_k=0, entropy=False, argmax=False) -> None:
    """The forward's outputs of ``case`` (numpy backend) into it: lp, [tlp, tid], [ent], [am]."""
    x, ids = case["x"], case["ids"]
    batch = x.shape[0]
    lp, rk = np.empty(batch, np.float32), np.empty(batch, np.int64)
    tlp = np.empty((batch, top_k), np.float32) if top_k else None
    tid = np.empty((batch, top_k), np.int64) if top_k else None
    ent = np.empty(batch, np.float32) if entropy else None
    am = np.empty(batch, np.int64) if argmax else None
    token_logprob_rank(
        x, ids, out_logprobs=lp, out_ranks=rk, stream=0, temperature=case.get("temp"), top_k=top_k,
        out_topk_logprobs=tlp, out_topk_ids=tid, out_entropy=ent, out_argmax=am,
    )  # fmt: skip
    case.update(lp=lp, tlp=tlp, tid=tid, ent=ent, am=am)


def reference_grads(case: dict):
    """float64 (grad of x, grad of T or None) by torch.log_softmax autograd."""
    x = torch.tensor(case["x"], dtype=torch.float64, requires_grad=True)
    batch, vocab = x.shape
    t = torch.tensor(case["temp"] if case.get("temp") is not None else np.ones(batch), dtype=torch.float64)
    t.requires_grad_(True)
    # a +-inf logit stays infinite at any T: no T gradient from it (x / T would give 0 * inf = NaN)
    finite = torch.isfinite(x)
    ls = torch.log_softmax(torch.where(finite, torch.where(finite, x, 0.0) / t[:, None], x), dim=-1)
    tok = torch.tensor(case["ids"])
    if case.get("am") is not None:
        tok = torch.where(tok < 0, torch.tensor(case["am"]), tok)
    valid = (tok >= 0) & (tok < vocab)
    loss = torch.zeros((), dtype=torch.float64)
    if case.get("g") is not None:
        picked = ls[torch.arange(batch), tok.clamp(0, vocab - 1)]
        loss = loss + torch.where(valid, picked * torch.tensor(case["g"], dtype=torch.float64), 0.0).sum()
    if case.get("gk") is not None:
        tid = torch.tensor(case["tid"])
        picked = ls.gather(1, tid.clamp(min=0))
        loss = loss + torch.where(tid >= 0, picked * torch.tensor(case["gk"], dtype=torch.float64), 0.0).sum()
    if case.get("ge") is not None:
        safe = torch.where(ls == -torch.inf, 0.0, ls)
        h = -(ls.exp() * safe).sum(-1)
        loss = loss + (h * torch.tensor(case["ge"], dtype=torch.float64)).sum()
    loss.backward()
    return x.grad.numpy(), (t.grad.numpy() if case.get("temp") is not None else None)


def assert_grads(case: dict, grad, grad_t, what: str, rows=None) -> None:
    """``grad`` (float32 view of the result, ``[batch, vocab]``) and ``grad_t`` against the
    reference, with mismatching places named."""
    ref, ref_t = reference_grads(case)
    rows = np.arange(ref.shape[0]) if rows is None else np.asarray(rows)
    ref, grad = ref[rows], np.asarray(grad, np.float64)[rows]
    scale = max(1.0, float(np.nanmax(np.abs(ref))))
    tol = 1e-5 * scale + RTOL[case["dtype"]] * np.abs(ref)
    bad = ~(np.abs(grad - ref) <= tol) & ~(np.isnan(grad) & np.isnan(ref))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        first = f"row {rows[r]} column {c}: got {grad[r, c]!r}, want {ref[r, c]!r}"
        raise AssertionError(f"{what}: {bad.sum()} gradients off, first at {first}")
    if case.get("grad_t"):
        assert grad_t is not None, what
        got_t = np.asarray(grad_t, np.float64)[rows]
        want_t = ref_t[rows]
        np.testing.assert_allclose(got_t, want_t, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want_t).max()), err_msg=what)


def special_case():
    """Rows: 0 plain, 1 NaN logit, 2 +inf logit, 3 all -inf, 4 the token's logit -inf (lp -inf:
    lse reduced again), 5 some -inf entries, 6 T = 0, 7 T = NaN, 8 id out of range (zeros)."""
    rng = np.random.default_rng(9)
    case = make_backward_case(rng, 9, 200, "float32", temp=True, grad_t=True, entropy=True, invalid_rows=(8,))
    x, ids = case["x"], case["ids"]
    x[1, 7], x[2, 9], x[3, :] = np.nan, np.inf, -np.inf
    x[4, ids[4]] = -np.inf
    x[5, [3, 50, 120]] = -np.inf
    ids[5] = 11
    case["temp"][6], case["temp"][7] = 0.0, np.nan
    case["ge"][8] = 0.0
    forward(case, entropy=True)
    case["ent"] = np.where(np.isfinite(case["ent"]), case["ent"], 0.0).astype(np.float32)  # row 4: finite H
    return case


def check_special(case, grad, grad_t, what):
    assert np.isnan(grad[[1, 2, 3, 6, 7]]).all() and np.isnan(grad_t[[1, 2, 3, 6, 7]]).all(), what
    assert (grad[8] == 0).all() and grad_t[8] == 0, what
    assert (grad[5, [3, 50, 120]] == 0).all(), what
    assert_grads(case, grad, grad_t, what, rows=[0, 5])
    assert np.isfinite(grad[4]).all() and grad[4, case["ids"][4]] != 0, what
