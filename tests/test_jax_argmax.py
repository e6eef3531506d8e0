"""trace_replay_jax.token_logprob_rank(argmax=True): each row's greedy token from the same pass
over the logits, and rows with a negative token id scored as it. Both methods, eagerly, under
``jax.jit`` and inside ``lax.fori_loop``, against ``greedy_argmax_reference`` and the float64
``token_logprob_rank_reference`` (CPU tier; the GPU checks are in ``test_gpu_jax_adapter.py``).

The data is ``test_logprob_argmax.greedy_case``'s: every odd row greedy (id -1), ties at the
maximum (planted late in the row, and on a grid of 0.5), ``-inf`` entries, explicit tokens at the
maximum, tied with other entries or ``-inf``, and special rows, each once explicit and once
greedy: only ``-inf``, only NaN, NaN and ``-inf``, one finite entry, a ``+inf``, a NaN among
finite values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest
from helpers.argmax_cases import assert_greedy, greedy_case  # noqa: E402
from helpers.jax_helpers import x64  # noqa: E402
from helpers.topk_cases import assert_topk, processed, tied_case  # noqa: E402

from trace_replay_jax import LogprobRank, LogprobRankArgmax, LogprobRankTopKArgmax, token_logprob_rank  # noqa: E402

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
METHODS = ("kernel", "jnp")
SIZES = ((1, 1), (1, 1000), (13, 1000), (40, 3000))


def _jax(x, ids, dtype):
    return jnp.asarray(x).astype(JNP_DTYPES[dtype]), jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", list(JNP_DTYPES))
@pytest.mark.parametrize("batch,vocab", SIZES, ids=[f"b{b}-v{v}" for b, v in SIZES])
def test_argmax_and_greedy_rows_match_reference(batch, vocab, dtype, method):
    x, ids = greedy_case(np.random.default_rng(batch * 7919 + vocab), batch, vocab, dtype)
    logits, ids_j = _jax(x, ids, dtype)
    jitted = jax.jit(lambda a, b: token_logprob_rank(a, b, method=method, argmax=True))
    for mode, fn in (("eager", lambda a, b: token_logprob_rank(a, b, method=method, argmax=True)), ("jit", jitted)):
        res = fn(logits, ids_j)
        assert isinstance(res, LogprobRankArgmax), type(res)
        # planted: the planted rows say what they should (greedy row 1's ties: the first copy wins,
        # all count; NaN then -inf: the first -inf; only -inf; only NaN; +inf wins), where the batch holds them.
        assert_greedy(
            x, ids, res.logprobs, res.ranks, res.argmax, f"{method} {mode} {batch}x{vocab} {dtype}", planted=True
        )


@pytest.mark.parametrize("method", METHODS)
def test_without_argmax_a_negative_id_stays_invalid(method):
    x, ids = greedy_case(np.random.default_rng(4), 6, 100, "float32")
    res = token_logprob_rank(*_jax(x, ids, "float32"), method=method)
    assert isinstance(res, LogprobRank)
    assert np.isnan(np.asarray(res.logprobs)[ids < 0]).all() and (np.asarray(res.ranks)[ids < 0] == -1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_greedy_rows_have_the_bits_of_their_explicit_ids_in_any_batch(dtype):
    x, ids = greedy_case(np.random.default_rng(8), 24, 3000, dtype)
    logits, ids_j = _jax(x, ids, dtype)
    lp, rk, am = token_logprob_rank(logits, ids_j, argmax=True)
    explicit = jnp.where(ids_j < 0, am, ids_j)
    for flag in (False, True):  # the same bits with or without out_argmax
        got = token_logprob_rank(logits, explicit, argmax=flag)
        assert np.array_equal(np.asarray(got.logprobs).view(np.uint32), np.asarray(lp).view(np.uint32)), flag
        assert np.array_equal(np.asarray(got.ranks), np.asarray(rk)), flag
    for r in (0, 1, 3, 4, 5, *range(6, 20), 23):  # one row alone gives that row's bits (6-19: the special rows)
        one = token_logprob_rank(logits[r : r + 1], ids_j[r : r + 1], argmax=True)
        assert np.asarray(one.logprobs).view(np.uint32)[0] == np.asarray(lp).view(np.uint32)[r], r
        assert (int(one.ranks[0]), int(one.argmax[0])) == (int(rk[r]), int(am[r])), r


@pytest.mark.parametrize("method", METHODS)
def test_inside_fori_loop_same_as_eager(method):
    steps, batch, vocab = 4, 9, 777
    rng = np.random.default_rng(17)
    cases = [greedy_case(rng, batch, vocab, "float32") for _ in range(steps)]
    xs, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases]).astype(np.int32)

    @jax.jit
    def run(xs, ids):
        def body(k, acc):
            res = token_logprob_rank(xs[k], ids[k], method=method, argmax=True)
            return tuple(a.at[k].set(v) for a, v in zip(acc, res))

        init = (
            jnp.full((steps, batch), 777.0, jnp.float32),
            jnp.full((steps, batch), -999, jnp.int32),
            jnp.full((steps, batch), -999, jnp.int32),
        )
        return jax.lax.fori_loop(0, steps, body, init)

    lp, rk, am = run(jnp.asarray(xs), jnp.asarray(ids))
    for k in range(steps):
        assert_greedy(xs[k], ids[k], lp[k], rk[k], am[k], f"{method} fori step {k}")
        eager = token_logprob_rank(jnp.asarray(xs[k]), jnp.asarray(ids[k]), method=method, argmax=True)
        assert np.array_equal(np.asarray(eager.argmax), np.asarray(am[k]))
        assert np.array_equal(np.asarray(eager.ranks), np.asarray(rk[k]))
        if method == "kernel":  # the same compiled reduction: the same bits
            assert np.array_equal(np.asarray(eager.logprobs).view(np.uint32), np.asarray(lp[k]).view(np.uint32))


@pytest.mark.parametrize("method", METHODS)
def test_top_k_and_temperature_with_argmax(method):
    x, ids, temp = tied_case(np.random.default_rng(6), 9, 700, "float32", 8)
    ids[::3] = -1
    fn = jax.jit(lambda a, b, c: token_logprob_rank(a, b, method=method, top_k=8, temperature=c, argmax=True))
    for t in (None, temp):
        res = fn(jnp.asarray(x), jnp.asarray(ids, jnp.int32), None if t is None else jnp.asarray(t))
        assert isinstance(res, LogprobRankTopKArgmax) and res.topk_ids.shape == (9, 8)
        y = processed(x, t)
        assert_greedy(y, ids, res.logprobs, res.ranks, res.argmax, f"{method} T={t is not None}")
        assert_topk(y, 8, np.asarray(res.topk_logprobs), np.asarray(res.topk_ids), f"{method} top-k")
        assert np.array_equal(np.asarray(res.topk_ids)[:, 0], np.asarray(res.argmax))  # no all-NaN row here
        plain = token_logprob_rank(
            jnp.asarray(x),
            jnp.asarray(np.where(ids < 0, res.argmax, ids), jnp.int32),
            method=method,
            top_k=8,
            temperature=None if t is None else jnp.asarray(t),
        )
        assert np.array_equal(np.asarray(plain.topk_ids), np.asarray(res.topk_ids))


def test_int64_ids_empty_batch_and_gradient():
    x, ids = greedy_case(np.random.default_rng(11), 9, 500, "float32")
    with x64():
        for method in METHODS:
            res = token_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int64)[:, None], method=method, argmax=True)
            assert_greedy(x, ids, res.logprobs, res.ranks, res.argmax, f"x64 {method}")
    for method in METHODS:
        res = token_logprob_rank(jnp.zeros((0, 10)), jnp.zeros((0,), jnp.int32), method=method, top_k=2, argmax=True)
        assert isinstance(res, LogprobRankTopKArgmax) and res.argmax.shape == (0,) and res.argmax.dtype == jnp.int32
    z = jnp.asarray(np.random.default_rng(2).standard_normal((3, 50), dtype=np.float32))
    greedy = jnp.full((3,), -1, jnp.int32)
    grad = jax.grad(lambda a: token_logprob_rank(a, greedy, method="jnp", argmax=True).logprobs.sum())(z)
    want = np.eye(50, dtype=np.float32)[np.argmax(np.asarray(z), axis=1)] - np.asarray(jax.nn.softmax(z, axis=1))
    np.testing.assert_allclose(np.asarray(grad), want, atol=1e-6)


BAD_ARGMAX = {
    "int": (1, r"^argmax must be a bool \(got int 1\)"),
    "none": (None, r"^argmax must be a bool \(got NoneType None\)"),
    "str": ("yes", r"^argmax must be a bool \(got str 'yes'\)"),
    "array": (jnp.asarray(True), r"^argmax must be a bool \(got ArrayImpl "),
}


@pytest.mark.parametrize("case", list(BAD_ARGMAX))
@pytest.mark.parametrize("traced", [False, True])
def test_bad_argmax_names_the_argument_and_the_value(case, traced):
    value, pattern = BAD_ARGMAX[case]

    def call(a, b):
        return token_logprob_rank(a, b, argmax=value)

    if traced:
        call = jax.jit(call)
    with pytest.raises(TypeError, match=pattern):
        call(jnp.ones((3, 10), jnp.float32), jnp.zeros((3,), jnp.int32))
