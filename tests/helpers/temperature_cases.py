"""Temperatures that are not finite and > 0 (``T <= 0``, NaN, infinite): the same cases run
against every method of both frameworks (``test_logprob_temperature.py`` on the CPU,
``test_gpu_logprob_backward.py`` on a GPU). Such a row is scored as a row of NaN logits:
logprob, top-k logprobs and entropy NaN, rank 0, top-k ids -1, argmax 0; the other rows as
``logits / T`` (checked against the float64 reference)."""

from __future__ import annotations

import numpy as np

from trace_replay_core import softmax_entropy_reference, token_logprob_rank_reference

TOP_K = 3
# name -> (scalar or per-row T); rows 0 and 4 of the array keep a good T
CASES = {
    "scalar-zero": 0.0,
    "scalar-negative": -1.0,
    "scalar-nan": float("nan"),
    "scalar-inf": float("inf"),
    "array-mixed": np.array([1.5, 0.0, -1.0, np.nan, 0.7, np.inf, -0.0], np.float32),
}
BATCH, VOCAB = 7, 300


def case_data(seed: int = 5):
    """float32 logits (exact in bfloat16), int64 ids, all valid."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((BATCH, VOCAB)) * 3).astype(np.float32)
    x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # exact in bfloat16
    x[x == 0] = 0.5
    return x, rng.integers(0, VOCAB, BATCH).astype(np.int64)


def per_row(temperature) -> np.ndarray:
    return np.broadcast_to(np.asarray(temperature, np.float32), (BATCH,)).copy()


def assert_temperature_results(x, ids, temperature, lp, rk, tlp, tid, am, ent, what: str) -> None:
    """The results of one call with ``top_k=TOP_K, argmax=True, entropy=True`` (numpy arrays)."""
    t = per_row(temperature)
    bad = ~(np.isfinite(t) & (t > 0))
    assert bad.any(), what
    lp, rk, tlp, tid, am, ent = (np.asarray(a) for a in (lp, rk, tlp, tid, am, ent))
    assert np.isnan(lp[bad]).all(), f"{what}: logprobs of bad rows {lp[bad]}"
    assert (rk[bad] == 0).all(), f"{what}: ranks of bad rows {rk[bad]}"
    assert np.isnan(tlp[bad]).all() and (tid[bad] == -1).all(), f"{what}: top-k of bad rows {tid[bad]}"
    assert (am[bad] == 0).all(), f"{what}: argmax of bad rows {am[bad]}"
    assert np.isnan(ent[bad]).all(), f"{what}: entropy of bad rows {ent[bad]}"
    good = ~bad
    if good.any():
        y = x[good].astype(np.float32) / t[good, None]
        ref_lp, ref_rk = token_logprob_rank_reference(y, ids[good])
        np.testing.assert_allclose(lp[good], ref_lp, rtol=1e-5, atol=2e-5, err_msg=what)
        np.testing.assert_array_equal(rk[good], ref_rk, err_msg=what)
        np.testing.assert_array_equal(am[good], np.argmax(y, axis=1), err_msg=what)
        np.testing.assert_allclose(ent[good], softmax_entropy_reference(y), rtol=1e-5, atol=1e-5, err_msg=what)


def torch_methods(device: str):
    """name -> fn(x numpy, ids numpy, temperature) -> the six results as numpy, for torch."""
    import torch

    from trace_replay_torch import token_logprob_rank, token_logprob_rank_op

    def args(x, ids, temperature):
        t = temperature if np.ndim(temperature) == 0 else torch.from_numpy(temperature).to(device)
        return torch.from_numpy(x).to(device), torch.from_numpy(ids).to(device), t

    def run(fn, dtype):
        def call(x, ids, temperature):
            logits, tok, t = args(x, ids, temperature)
            res = fn(logits.to(dtype), tok, top_k=TOP_K, temperature=t, argmax=True, entropy=True)
            return [r.cpu().numpy() for r in res]

        return call

    return {
        "torch-eager-f32": run(token_logprob_rank, torch.float32),
        "torch-eager-bf16": run(token_logprob_rank, torch.bfloat16),
        "torch-op-f32": run(token_logprob_rank_op, torch.float32),
    }


def jax_methods(device):
    """name -> fn(x, ids, temperature) -> the six results as numpy, for JAX on ``device``."""
    import jax
    import jax.numpy as jnp

    from trace_replay_jax import token_logprob_rank

    def run(method, dtype, jit):
        def call(x, ids, temperature):
            logits = jax.device_put(jnp.asarray(x, dtype), device)
            tok = jax.device_put(jnp.asarray(ids, jnp.int32), device)
            t = temperature if np.ndim(temperature) == 0 else jax.device_put(jnp.asarray(temperature), device)

            def f(a, b, c):
                return token_logprob_rank(a, b, method=method, top_k=TOP_K, temperature=c, argmax=True, entropy=True)

            res = jax.jit(f)(logits, tok, t) if jit and np.ndim(t) else f(logits, tok, t)
            return [np.asarray(r) for r in res]

        return call

    methods = {}
    for method in ("kernel", "jnp"):
        methods[f"jax-{method}-f32"] = run(method, jnp.float32, False)
        methods[f"jax-{method}-bf16-jit"] = run(method, jnp.bfloat16, True)
    return methods
