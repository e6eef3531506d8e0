"""``token_logprob_rank_sharded`` on a one-device mesh, in this process (the 8-device cases are
``tests/jax_mesh_cases.py``): its named result and the options of ``token_logprob_rank`` that it
does not compute, refused by name (before: a plain tuple, and Python's "unexpected keyword")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import trace_replay_jax as trj
from trace_replay_jax.sharded import token_logprob_rank_sharded


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("batch", "vocab"))


def test_sharded_logprob_returns_the_named_result(rng):
    mesh = _mesh()
    logits = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 24, 5), jnp.int32)
    want = trj.token_logprob_rank(logits, ids, method="jnp")
    eager = token_logprob_rank_sharded(logits, ids, mesh=mesh, vocab_axis="vocab", batch_axis="batch")
    jitted = jax.jit(lambda x, i: token_logprob_rank_sharded(x, i, mesh=mesh, vocab_axis="vocab"))(logits, ids)
    for got in (eager, jitted):
        assert type(got) is trj.LogprobRank
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=2e-6, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(got.ranks), np.asarray(want.ranks))


UNSUPPORTED = {
    "top_k": (
        dict(top_k=3),
        r"^token_logprob_rank_sharded does not compute top_k \(got 3\): it merges logprobs and ranks "
        r"only; for top_k, argmax or entropy call trace_replay_jax\.token_logprob_rank on logits "
        r"replicated over vocab_axis$",
    ),
    "argmax": (
        dict(argmax=True),
        r"^token_logprob_rank_sharded does not compute argmax \(got True\): it merges",
    ),
    "entropy": (
        dict(entropy=True),
        r"^token_logprob_rank_sharded does not compute entropy \(got True\): it merges",
    ),
    "temperature": (
        dict(temperature=0.7),
        r"^token_logprob_rank_sharded does not take temperature \(got 0\.7\): pass the logits divided "
        r"by it \(logits / T, or logits / T\[:, None\] for one T per row\): the results of "
        r"temperature=T are those of logits / T$",
    ),
}


@pytest.mark.parametrize("option", sorted(UNSUPPORTED))
def test_options_it_does_not_compute_are_refused_by_name(option):
    kwargs, pattern = UNSUPPORTED[option]
    logits, ids = jnp.zeros((2, 8), jnp.float32), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match=pattern):
        token_logprob_rank_sharded(logits, ids, mesh=_mesh(), vocab_axis="vocab", **kwargs)


WRONG_DTYPE = {
    "logits-int32": (
        dict(logits=jnp.zeros((2, 8), jnp.int32)),
        r"^logits must have dtype float32 or bfloat16 or float16 \(got int32\)$",
    ),
    "token_ids-int16": (
        dict(token_ids=jnp.zeros(2, jnp.int16)),
        r"^token_ids must have dtype int32 or int64 \(got int16\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_DTYPE))
def test_a_wrong_dtype_is_a_type_error_naming_the_argument(case):
    """As the core, the torch adapter, JAX replay and the unsharded op: a dtype is a TypeError."""
    change, pattern = WRONG_DTYPE[case]
    args = dict(logits=jnp.zeros((2, 8), jnp.float32), token_ids=jnp.zeros(2, jnp.int32)) | change
    with pytest.raises(TypeError, match=pattern):
        token_logprob_rank_sharded(args["logits"], args["token_ids"], mesh=_mesh(), vocab_axis="vocab")
