"""trace_replay_jax.token_logprob_rank: both methods, eager and inside jit/loops, CPU and (marked
``gpu``) GPU, against the float64 numpy reference.

The data, the reference and the tolerance argument are those of ``test_logprob_rank.py`` (random
logits never zero, planted ties, ``-inf`` entries; ranks exact; logprob within
``2e-5 + 3e-7 * (|chosen| + |lse|)``, float32 arithmetic on logits converted exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest
from helpers.jax_helpers import jax_gpu, x64  # noqa: E402
from helpers.logprob_cases import assert_matches_reference, assert_planted, assert_special, make_case, special_case  # noqa: E402

from trace_replay_jax import token_logprob_rank  # noqa: E402

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
METHODS = ("kernel", "jnp")
CPU_GRID = [(b, v, d) for d in JNP_DTYPES for b in (1, 7, 256) for v in (1, 1000, 32000) if b * v <= 1 << 23]


def _on(device, x, dtype):
    return jax.device_put(jnp.asarray(x, dtype=jnp.float32).astype(JNP_DTYPES[dtype]), device)


def _check_all_ways(x, ids, dtype, device, what):
    """Eagerly and under jit, for both methods: same contract, same ranks."""
    logits = _on(device, x, dtype)
    ids_j = jax.device_put(jnp.asarray(ids.astype(np.int32)), device)
    jitted = {m: jax.jit(lambda a, b, m=m: token_logprob_rank(a, b, method=m)) for m in METHODS}
    for method in METHODS:
        for mode, fn in (("eager", lambda a, b, m=method: token_logprob_rank(a, b, method=m)), ("jit", jitted[method])):
            lp, rk = fn(logits, ids_j)
            assert lp.dtype == jnp.float32 and rk.dtype == jnp.int32, (lp.dtype, rk.dtype)
            assert lp.shape == rk.shape == (x.shape[0],)
            assert_matches_reference(x, ids, np.asarray(lp), np.asarray(rk), f"{what} {method} {mode}")
            assert_planted(x, ids, np.asarray(rk))


@pytest.mark.parametrize("batch,vocab,dtype", CPU_GRID, ids=[f"b{b}-v{v}-{d}" for b, v, d in CPU_GRID])
def test_cpu_matches_reference(batch, vocab, dtype):
    rng = np.random.default_rng(batch * 104729 + vocab)
    x, ids = make_case(rng, batch, vocab, dtype)
    _check_all_ways(x, ids, dtype, jax.devices("cpu")[0], f"cpu {batch}x{vocab} {dtype}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", list(JNP_DTYPES))
def test_special_values(method, dtype):
    x, ids, expect = special_case()
    x = np.asarray(jnp.asarray(x).astype(JNP_DTYPES[dtype]).astype(jnp.float32))
    ids32 = np.where(np.abs(ids) > 2**30, 2**30, ids)  # int32 ids: "huge" is still out of range
    lp, rk = token_logprob_rank(jnp.asarray(x).astype(JNP_DTYPES[dtype]), jnp.asarray(ids32, jnp.int32), method=method)
    assert_special(x, ids32, np.asarray(lp), np.asarray(rk), expect, f"jax {method} special {dtype}")


@pytest.mark.parametrize("method", METHODS)
def test_inside_fori_loop_with_new_logits_each_step(method, rng):
    steps, batch, vocab = 5, 6, 777
    xs = rng.standard_normal((steps, batch, vocab), dtype=np.float32) * 3
    xs[xs == 0] = 0.25
    ids = rng.integers(0, vocab, size=(steps, batch)).astype(np.int32)

    @jax.jit
    def run(xs, ids):
        def body(k, acc):
            lp, rk = token_logprob_rank(xs[k], ids[k], method=method)
            return acc[0].at[k].set(lp), acc[1].at[k].set(rk)

        init = (jnp.full((steps, batch), 777.0, jnp.float32), jnp.full((steps, batch), -999, jnp.int32))
        return jax.lax.fori_loop(0, steps, body, init)

    lp, rk = run(jnp.asarray(xs), jnp.asarray(ids))
    for k in range(steps):
        assert_matches_reference(xs[k], ids[k], np.asarray(lp[k]), np.asarray(rk[k]), f"fori step {k}")


def test_int64_ids_with_x64_and_column_ids():
    rng = np.random.default_rng(11)
    x, ids = make_case(rng, 9, 500, "float32")
    with x64():
        for method in METHODS:
            lp, rk = token_logprob_rank(jnp.asarray(x), jnp.asarray(ids, jnp.int64)[:, None], method=method)
            assert_matches_reference(x, ids, np.asarray(lp), np.asarray(rk), f"x64 {method}")


@pytest.mark.parametrize("method", METHODS)
def test_both_methods_are_differentiable(method):
    """One-hot minus softmax (test_jax_logprob_grad.py checks every output and the temperature)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 50), dtype=np.float32))
    ids = jnp.asarray([4, 0, 49], jnp.int32)
    grad = jax.grad(lambda z: token_logprob_rank(z, ids, method=method)[0].sum())(x)
    want = np.eye(50, dtype=np.float32)[np.asarray(ids)] - np.asarray(jax.nn.softmax(x, axis=1))
    np.testing.assert_allclose(np.asarray(grad), want, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_folds_the_mapped_axis(method):
    x = jax.random.normal(jax.random.key(3), (2, 3, 10), jnp.float32)
    ids = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    lp, rk = jax.vmap(lambda z, i: token_logprob_rank(z, i, method=method))(x, ids)
    want = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), ids[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want), atol=2e-6)
    assert rk.shape == (2, 3)


_X = jnp.ones((3, 10), jnp.float32) * 0.5
_IDS = jnp.zeros((3,), jnp.int32)
BAD = {
    "method": (dict(method="triton"), ValueError, r"^method must be one of \('kernel', 'jnp'\) \(got 'triton'\)"),
    "logits-1d": (dict(logits=jnp.ones(10)), ValueError, r"^logits must be 2-D \[batch, vocab\] \(got shape \[10\]\)"),
    "logits-int": (
        dict(logits=jnp.ones((3, 10), jnp.int32)),
        TypeError,
        r"^logits must have dtype float32 or bfloat16 or float16 \(got int32\)",
    ),
    "logits-no-vocab": (dict(logits=jnp.ones((3, 0))), ValueError, r"^logits must have between 1 and"),
    "logits-list": (dict(logits=[[1.0]]), TypeError, r"^logits must be a JAX or numpy array \(got list\)"),
    "ids-rows": (
        dict(token_ids=jnp.zeros((4,), jnp.int32)),
        ValueError,
        r"^token_ids must be \[batch\] or \[batch, 1\] with batch = 3.*\(got shape \[4\]\)",
    ),
    "ids-two-per-row": (
        dict(token_ids=jnp.zeros((3, 2), jnp.int32)),
        ValueError,
        r"^token_ids must be \[batch\] or \[batch, 1\].*\(got shape \[3, 2\]\)",
    ),
    "ids-float": (
        dict(token_ids=jnp.zeros((3,), jnp.float32)),
        TypeError,
        r"^token_ids must have dtype int32 or int64 \(got float32\)",
    ),
    "ids-int16": (
        dict(token_ids=jnp.zeros((3,), jnp.int16)),
        TypeError,
        r"^token_ids must have dtype int32 or int64 \(got int16\)",
    ),
    "temperature-float16": (
        dict(temperature=jnp.ones((3,), jnp.float16)),
        TypeError,
        r"^temperature must have dtype float32 \(got float16\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("traced", [False, True])
def test_errors_name_the_argument(case, traced):
    change, exc, pattern = BAD[case]
    args = dict(logits=_X, token_ids=_IDS, method="kernel", temperature=None) | change
    method = args.pop("method")

    def call(a, b, t):
        return token_logprob_rank(a, b, method=method, temperature=t)

    if traced and case != "logits-list":
        call = jax.jit(call)
    with pytest.raises(exc, match=pattern):
        call(args["logits"], args["token_ids"], args["temperature"])


# -- the GPU --------------------------------------------------------------------------------------

# The torch tier covers the kernel on the whole size grid; here the JAX path on the sizes that
# change its plan (split rows at small batches, one program per row from 256) and the largest vocab.
GPU_SIZES = ((1, 151936), (7, 262144), (256, 151936), (1024, 1000), (1024, 151936))
GPU_GRID = [(b, v, d) for d in JNP_DTYPES for b, v in GPU_SIZES]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,vocab,dtype", GPU_GRID, ids=[f"b{b}-v{v}-{d}" for b, v, d in GPU_GRID])
def test_gpu_matches_reference(batch, vocab, dtype):
    gpu = jax_gpu()
    rng = np.random.default_rng(batch * 31 + vocab)
    x, ids = make_case(rng, batch, vocab, dtype)
    _check_all_ways(x, ids, dtype, gpu, f"gpu {batch}x{vocab} {dtype}")


@pytest.mark.gpu
def test_gpu_new_buffers_every_call_and_inside_a_loop():
    """A jitted step fed fresh arrays (new device addresses) every call must never reuse results
    recorded for old buffers (the kernel op is command-buffer compatible)."""
    gpu = jax_gpu()
    rng = np.random.default_rng(21)
    step = jax.jit(lambda a, b: token_logprob_rank(a * 1.0, b))
    for k in range(6):
        x, ids = make_case(rng, 33, 32000, "bfloat16")
        lp, rk = step(_on(gpu, x, "bfloat16"), jax.device_put(jnp.asarray(ids, jnp.int32), gpu))
        assert_matches_reference(x, ids, np.asarray(lp), np.asarray(rk), f"gpu call {k}")

    xs = rng.standard_normal((4, 5, 151936), dtype=np.float32)
    ids = rng.integers(0, 151936, size=(4, 5)).astype(np.int32)

    @jax.jit
    def loop(xs, ids):
        def body(k, acc):
            lp, rk = token_logprob_rank(xs[k], ids[k])
            return acc[0].at[k].set(lp), acc[1].at[k].set(rk)

        return jax.lax.fori_loop(0, 4, body, (jnp.zeros((4, 5)), jnp.zeros((4, 5), jnp.int32)))

    lp, rk = loop(jax.device_put(jnp.asarray(xs), gpu), jax.device_put(jnp.asarray(ids), gpu))
    for k in range(4):
        assert_matches_reference(xs[k], ids[k], np.asarray(lp[k]), np.asarray(rk[k]), f"gpu fori step {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_special_values(method):
    gpu = jax_gpu()
    x, ids, expect = special_case(151936)
    ids32 = np.where(np.abs(ids) > 2**30, 2**30, ids)
    lp, rk = token_logprob_rank(
        _on(gpu, x, "float32"), jax.device_put(jnp.asarray(ids32, jnp.int32), gpu), method=method
    )
    assert_special(x, ids32, np.asarray(lp), np.asarray(rk), expect, f"gpu jax {method} special")
