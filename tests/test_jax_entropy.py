"""trace_replay_jax.token_logprob_rank(entropy=True): each row's entropy, both methods, eagerly,
under ``jax.jit`` and inside ``lax.fori_loop``, against the float64 reference of
``helpers/entropy_cases.py`` (CPU tier: the kernel method runs the core's numpy backend through the
same buffer callback; the GPU checks are in ``test_gpu_jax_adapter.py``). Also: with top-k, argmax
and a temperature at once, the result types, the jnp method's gradient, refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest
from helpers.entropy_cases import assert_entropy, entropy_case, entropy_ref  # noqa: E402
from helpers.jax_helpers import x64  # noqa: E402
from helpers.logprob_cases import assert_matches_reference  # noqa: E402

from trace_replay_core import greedy_argmax_reference  # noqa: E402
from trace_replay_jax import (  # noqa: E402
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    token_logprob_rank,
)

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
METHODS = ("kernel", "jnp")
SIZES = ((1, 1), (9, 300), (23, 1000))


def _jax(x, ids, dtype):
    return jnp.asarray(x).astype(JNP_DTYPES[dtype]), jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", list(JNP_DTYPES))
@pytest.mark.parametrize("batch,vocab", SIZES, ids=[f"b{b}-v{v}" for b, v in SIZES])
def test_entropy_matches_reference_eager_and_jitted(batch, vocab, dtype, method):
    x, ids = entropy_case(np.random.default_rng(batch * 7919 + vocab), batch, vocab, dtype)
    logits, ids_j = _jax(x, ids, dtype)
    jitted = jax.jit(lambda a, b: token_logprob_rank(a, b, method=method, entropy=True))
    for mode, fn in (("eager", lambda a, b: token_logprob_rank(a, b, method=method, entropy=True)), ("jit", jitted)):
        res = fn(logits, ids_j)
        assert isinstance(res, LogprobRankEntropy) and res.entropy.dtype == jnp.float32, type(res)
        assert_entropy(x, np.asarray(res.entropy), f"{method} {mode} {batch}x{vocab} {dtype}", planted=True)
        assert_matches_reference(x, ids, res.logprobs, res.ranks, f"{method} {mode}")


@pytest.mark.parametrize("method", METHODS)
def test_top_k_argmax_and_temperature_with_entropy(method):
    rng = np.random.default_rng(6)
    x, ids = entropy_case(rng, 11, 400, "float32")
    ids[::3] = -1
    temp = rng.uniform(0.4, 2.0, 11).astype(np.float32)
    y = x / temp[:, None]
    want_am = greedy_argmax_reference(y)
    fn = jax.jit(
        lambda a, b, c, k, am: token_logprob_rank(a, b, method=method, top_k=k, temperature=c, argmax=am, entropy=True),
        static_argnums=(3, 4),
    )
    for top_k, argmax, cls in ((4, True, LogprobRankTopKArgmaxEntropy), (4, False, LogprobRankTopKEntropy)):
        res = fn(jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(temp), top_k, argmax)
        assert type(res) is cls and res._fields[-1] == "entropy"
        assert_entropy(y, np.asarray(res.entropy), f"{method} top-k argmax={argmax}")
        if argmax:
            assert np.asarray(res.argmax).tolist() == want_am.tolist()
    res = token_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int32), method=method, argmax=True, entropy=True)
    assert type(res) is LogprobRankArgmaxEntropy and res._fields == ("logprobs", "ranks", "argmax", "entropy")
    assert_entropy(x, np.asarray(res.entropy), f"{method} argmax entropy", planted=True)


def test_kernel_method_rows_have_the_same_bits_in_any_batch():
    x, ids = entropy_case(np.random.default_rng(8), 24, 3000, "bfloat16")
    logits, ids_j = _jax(x, ids, "bfloat16")
    whole = np.asarray(token_logprob_rank(logits, ids_j, entropy=True).entropy)
    for rows in ([0], [5, 1, 23], list(range(23, -1, -1))):
        part = token_logprob_rank(logits[np.array(rows)], ids_j[np.array(rows)], entropy=True).entropy
        assert np.asarray(part).tobytes() == whole[rows].tobytes(), rows


@pytest.mark.parametrize("method", METHODS)
def test_inside_fori_loop_same_as_eager(method):
    steps, batch, vocab = 3, 9, 257
    rng = np.random.default_rng(17)
    cases = [entropy_case(rng, batch, vocab, "float32") for _ in range(steps)]
    xs, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases]).astype(np.int32)

    @jax.jit
    def run(xs, ids):
        def body(k, acc):
            return acc.at[k].set(token_logprob_rank(xs[k], ids[k], method=method, entropy=True).entropy)

        return jax.lax.fori_loop(0, steps, body, jnp.full((steps, batch), jnp.nan, jnp.float32))

    ent = np.asarray(run(jnp.asarray(xs), jnp.asarray(ids)))
    for k in range(steps):
        assert_entropy(xs[k], ent[k], f"{method} fori step {k}", planted=True)
        if method == "kernel":  # the same computation: the same bits
            eager = token_logprob_rank(jnp.asarray(xs[k]), jnp.asarray(ids[k]), method=method, entropy=True).entropy
            assert np.asarray(eager).tobytes() == ent[k].tobytes()


def test_gradient_of_the_entropy_in_both_methods():
    """d H / d y_j = -p_j (log p_j + H); -inf entries get 0 (no NaN from their 0 * -inf)."""
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3, 50)).astype(np.float32)
    z[1, ::7] = -np.inf
    ids = jnp.zeros((3,), jnp.int32)
    grad = jax.grad(lambda a: token_logprob_rank(a, ids, method="jnp", entropy=True).entropy.sum())(jnp.asarray(z))
    p = np.asarray(jax.nn.softmax(jnp.asarray(z), axis=1), np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = np.where(p > 0, np.log(p), 0.0)
    h = entropy_ref(z)
    want = -p * (log_p + h[:, None])
    np.testing.assert_allclose(np.asarray(grad), want, atol=2e-6)
    kernel = jax.grad(lambda a: token_logprob_rank(a, ids, entropy=True).entropy.sum())(jnp.asarray(z))
    np.testing.assert_allclose(np.asarray(kernel), want, atol=2e-6)


def test_int64_ids_and_empty_batch():
    x, ids = entropy_case(np.random.default_rng(11), 9, 500, "float32")
    with x64():
        for method in METHODS:
            res = token_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int64)[:, None], method=method, entropy=True)
            assert_entropy(x, np.asarray(res.entropy), f"x64 {method}", planted=True)
    for method in METHODS:
        res = token_logprob_rank(
            jnp.zeros((0, 10)), jnp.zeros((0,), jnp.int32), method=method, top_k=2, argmax=True, entropy=True
        )
        assert isinstance(res, LogprobRankTopKArgmaxEntropy)
        assert res.entropy.shape == (0,) and res.entropy.dtype == jnp.float32


BAD_ENTROPY = {
    "int": (1, r"^entropy must be a bool \(got int 1\)"),
    "none": (None, r"^entropy must be a bool \(got NoneType None\)"),
    "array": (jnp.asarray(True), r"^entropy must be a bool \(got ArrayImpl "),
}


@pytest.mark.parametrize("case", list(BAD_ENTROPY))
@pytest.mark.parametrize("traced", [False, True])
def test_bad_entropy_names_the_argument_and_the_value(case, traced):
    value, pattern = BAD_ENTROPY[case]

    def call(a, b):
        return token_logprob_rank(a, b, entropy=value)

    if traced:
        call = jax.jit(call)
    with pytest.raises(TypeError, match=pattern):
        call(jnp.ones((3, 10), jnp.float32), jnp.zeros((3,), jnp.int32))
