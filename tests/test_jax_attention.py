"""The JAX families' masked decode contractions (``drivers/jax_attention.py``) against a float64
numpy reference, and the attention each device and dtype gets."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_replay_app.drivers.jax_attention import attention_for, cache_mix, cache_scores

# (rows, kv_len, kv_heads, groups, head_dim): grouped queries, one head per group, odd sizes
SHAPES = [(3, 17, 2, 3, 8), (1, 5, 4, 1, 16), (5, 33, 1, 7, 4)]


def _round(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


# bfloat16: within one bfloat16 step (2**-7 of the value at most) of the float64 result rounded to
# bfloat16, as float32 sums give; sums in bfloat16 are several steps off (up to 17 here).
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, (2e-6, 2e-6)), (jnp.bfloat16, (2**-7, 1e-4))])
@pytest.mark.parametrize("shape", SHAPES)
def test_contractions_match_float64(shape, dtype, tol):
    rows, kv_len, kv_heads, groups, d = shape
    rng = np.random.default_rng(sum(shape))
    q = jnp.asarray(rng.standard_normal((rows, kv_heads, groups, d)), jnp.float32).astype(dtype)
    keys = jnp.asarray(rng.standard_normal((rows, kv_len, kv_heads, d)), jnp.float32).astype(dtype)
    values = jnp.asarray(rng.standard_normal((rows, kv_len, kv_heads, d)), jnp.float32).astype(dtype)
    qf, kf, vf = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, keys, values))

    scores = cache_scores(q, keys)
    assert scores.shape == (rows, kv_len, kv_heads, groups) and scores.dtype == dtype
    want = np.einsum("bkgd,btkd->btkg", qf, kf)
    np.testing.assert_allclose(np.asarray(scores.astype(jnp.float32)), _round(want, dtype), rtol=tol[0], atol=tol[1])

    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=1).astype(dtype)
    out = cache_mix(probs, values)
    assert out.shape == (rows, kv_heads, groups, d) and out.dtype == dtype
    want = np.einsum("btkg,btkd->bkgd", np.asarray(probs.astype(jnp.float32), np.float64), vf)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), _round(want, dtype), rtol=tol[0], atol=tol[1])


def test_each_row_reads_only_its_own_slot():
    """A change in one slot's cache changes that row's results alone."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((4, 2, 2, 8)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((4, 9, 2, 8)), jnp.float32)
    other = keys.at[2].set(keys[2] + 1.0)
    a, b = np.asarray(cache_scores(q, keys)), np.asarray(cache_scores(q, other))
    assert not np.array_equal(a[2], b[2])
    np.testing.assert_array_equal(np.delete(a, 2, axis=0), np.delete(b, 2, axis=0))


def test_the_masked_step_copies_no_cache():
    """The point of the module: the compiled contractions never transpose or copy the cache."""
    q = jax.ShapeDtypeStruct((8, 2, 3, 16), jnp.float32)
    cache = jax.ShapeDtypeStruct((8, 96, 2, 16), jnp.float32)

    def step(q, keys, values):
        return cache_mix(jax.nn.softmax(cache_scores(q, keys), axis=1), values)

    text = jax.jit(step).lower(q, cache, cache).compile().as_text()
    big = [line for line in text.splitlines() if ("transpose(" in line or " copy(" in line) and "96" in line]
    assert big == []


@pytest.mark.parametrize(
    "platform, dtype, want",
    [("gpu", "bfloat16", "cudnn"), ("gpu", "float16", "cudnn"), ("gpu", "float32", "xla"), ("cpu", "bfloat16", "xla")],
)
def test_attention_for(platform, dtype, want):
    assert attention_for(types.SimpleNamespace(platform=platform), dtype) == want
