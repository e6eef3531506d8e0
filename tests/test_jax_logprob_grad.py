"""Gradients and vmap of trace_replay_jax.token_logprob_rank on the CPU, both methods: against
float64 ``torch.log_softmax`` autograd (helpers/backward_cases.py), ``jax.test_util.check_grads``,
``jax.vmap`` over the function, over ``jax.jit`` of it and over ``jax.grad`` of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.backward_cases import assert_grads, make_backward_case
from jax.test_util import check_grads

from trace_replay_jax import token_logprob_rank

METHODS = ("kernel", "jnp")
CASES = {
    "logprob": ({}, {}),
    "temp-grad": (dict(temp=True, grad_t=True), {}),
    "topk-entropy": (dict(top_k=3, entropy=True), dict(top_k=3, entropy=True)),
    "all-greedy-rows": (
        dict(temp=True, grad_t=True, top_k=2, entropy=True, argmax=True, invalid_rows=(1, 4)),
        dict(top_k=2, entropy=True, argmax=True),
    ),
}
JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _grads(method, case, flags, dtype, jit):
    x = jnp.asarray(case["x"], JNP_DTYPES[dtype])
    ids = jnp.asarray(case["ids"], jnp.int32)
    t = None if case.get("temp") is None else jnp.asarray(case["temp"])

    def loss(a, temp):
        r = token_logprob_rank(a, ids, method=method, temperature=temp, **flags)
        total = (r.logprobs * case["g"]).sum()
        if flags.get("top_k"):
            total += (r.topk_logprobs * case["gk"]).sum()
        if flags.get("entropy"):
            total += (r.entropy * case["ge"]).sum()
        return total

    fn = jax.grad(loss, argnums=(0, 1) if t is not None else 0)
    out = (jax.jit(fn) if jit else fn)(x, t)
    gx, gt = out if t is not None else (out, None)
    return np.asarray(gx, np.float32), None if gt is None else np.asarray(gt)


# eager runs cover every dtype; jit (the same kernels under tracing) runs float32 only
@pytest.mark.parametrize(
    "dtype, jit",
    [(d, False) for d in sorted(JNP_DTYPES)] + [("float32", True)],
    ids=lambda v: {False: "eager", True: "jit"}.get(v, v),
)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_matches_log_softmax(rng, name, method, dtype, jit):
    options, flags = CASES[name]
    case = make_backward_case(rng, 6, 113, dtype, **options)
    grad, grad_t = _grads(method, case, flags, dtype, jit)
    assert_grads(case, grad, grad_t, f"jax {method} {name} {dtype}")


@pytest.mark.parametrize("method", METHODS)
def test_check_grads(method):
    x = jax.random.normal(jax.random.key(0), (3, 21)) * 2
    t = jnp.asarray([0.7, 1.0, 1.6], jnp.float32)
    ids = jnp.asarray([0, 5, 20], jnp.int32)

    def f(a, temp):
        r = token_logprob_rank(a, ids, method=method, top_k=2, temperature=temp, entropy=True)
        return r.logprobs, r.topk_logprobs, r.entropy

    check_grads(f, (x, t), order=1, modes=["rev"], eps=1e-2, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_jit_and_grad(method):
    xb = jax.random.normal(jax.random.key(1), (3, 4, 40))
    ids = jnp.asarray([1, 2, 3, 39], jnp.int32)

    def ours(a):
        return token_logprob_rank(a, ids, method=method, entropy=True).logprobs

    def ref(a):
        return jax.nn.log_softmax(a)[jnp.arange(4), ids]

    for transform in (jax.vmap, lambda f: jax.vmap(jax.jit(f)), lambda f: jax.jit(jax.vmap(f))):
        np.testing.assert_allclose(transform(ours)(xb), jax.vmap(ref)(xb), atol=2e-6)
    vg = jax.vmap(jax.grad(lambda a: ours(a).sum()))(xb)
    np.testing.assert_allclose(vg, jax.vmap(jax.grad(lambda a: ref(a).sum()))(xb), atol=2e-6)
    gv = jax.grad(lambda a: jax.vmap(ours)(a).sum())(xb)
    np.testing.assert_allclose(gv, jax.grad(lambda a: jax.vmap(ref)(a).sum())(xb), atol=2e-6)
    # a mapped token axis and an unmapped temperature, top-k and argmax: every output gains the axis
    idsb = jnp.asarray(np.random.default_rng(0).integers(0, 40, (3, 4)), jnp.int32)
    res = jax.vmap(lambda a, i: token_logprob_rank(a, i, method=method, top_k=2, argmax=True, temperature=0.8))(
        xb, idsb
    )
    assert res.topk_ids.shape == (3, 4, 2) and res.argmax.shape == (3, 4)
    want = jnp.take_along_axis(jax.nn.log_softmax(xb / 0.8, axis=-1), idsb[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(res.logprobs, want, atol=2e-6)


def test_forward_mode_works_with_jnp_and_is_refused_by_the_kernel_method():
    """Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``): ``method="jnp"`` gives the
    derivatives of the logprobs (with respect to ``logits`` and ``temperature``) that reverse mode
    gives; the kernel method is a ``jax.custom_vjp`` (reverse mode, first order), refused by JAX's
    own errors. Should JAX or the kernel method learn forward mode, this test says so."""
    x = jax.random.normal(jax.random.key(2), (3, 17)) * 2
    t = jnp.asarray([0.7, 1.0, 1.6], jnp.float32)
    ids = jnp.asarray([0, 5, 16], jnp.int32)

    def logprobs(method):
        return lambda a, temp: token_logprob_rank(a, ids, method=method, temperature=temp).logprobs

    def ref(a, temp):
        return jax.nn.log_softmax(a / temp[:, None])[jnp.arange(3), ids]

    for jac in (jax.jacfwd, lambda f, argnums: jax.jit(jax.jacfwd(f, argnums))):
        got = jac(logprobs("jnp"), argnums=(0, 1))(x, t)
        want = jax.jacrev(ref, argnums=(0, 1))(x, t)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-6)
    tangents = (jax.random.normal(jax.random.key(3), x.shape), jnp.asarray([0.5, -1.0, 2.0], jnp.float32))
    _, tangent = jax.jvp(logprobs("jnp"), (x, t), tangents)
    np.testing.assert_allclose(tangent, jax.jvp(ref, (x, t), tangents)[1], atol=1e-5)
    for forward in (
        lambda: jax.jacfwd(logprobs("kernel"))(x, t),
        lambda: jax.jvp(logprobs("kernel"), (x, t), tangents),
    ):
        with pytest.raises(TypeError, match=r"(?i)forward-mode|jvp"):
            forward()
    # second order, forward over reverse
    got = jax.hessian(lambda a: logprobs("jnp")(a, t).sum())(x)
    np.testing.assert_allclose(got, jax.hessian(lambda a: ref(a, t).sum())(x), atol=1e-5)
    # the backward's own refusal: JAX's words and type depend on how the backward is lowered (a
    # buffer callback, JAX 0.10.2 on the CPU: ValueError "Buffer callbacks do not support JVP"; a
    # custom call: no differentiation rule, "not implemented"), so the pattern takes either
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=r"(?i)jvp|differentiat|not implemented"):
        jax.hessian(lambda a: logprobs("kernel")(a, t).sum())(x)
