"""``bench/qwen_shape.jax_pattern_params`` (the JAX parameters ``bench/models.py`` makes on the
device, at 8B too large to build on the host) has the tree, shapes and dtype of the JAX loop's own
``_params`` for every Llama model type, so a new model type's parameters cannot break the bench
only where it runs, on a GPU."""

from __future__ import annotations

import os
import sys

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from trace_replay_app.models.llama import jax_loop  # noqa: E402
from trace_replay_app.models.llama.config import MODEL_TYPES, default_config, seeded_weights  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import qwen_shape  # noqa: E402


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t != "mistral"])
def test_pattern_params_are_the_loops_params(model_type):
    config = default_config(model_type)
    want = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), jax_loop._params(config, seeded_weights(config)))
    got = qwen_shape.jax_pattern_params(config, jax.devices("cpu")[0], jnp.bfloat16)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    shapes = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), got, want)
    assert all(jax.tree.leaves(shapes))
