"""``bench/qwen_shape.jax_pattern_params`` (the JAX parameters ``bench/models.py`` makes on the
device, at 8B too large to build on the host) has the tree, shapes and dtype of the JAX loop's own
``_params`` for every Llama model type, so a new model type's parameters cannot break the bench
only where it runs, on a GPU."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest
from helpers import module_from_file

from trace_replay_app.models.llama import jax_loop
from trace_replay_app.models.llama.config import MODEL_TYPES, default_config, seeded_weights

qwen_shape = module_from_file(pathlib.Path(__file__).resolve().parents[1] / "bench" / "qwen_shape.py")


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t != "mistral"])
def test_pattern_params_are_the_loops_params(model_type):
    config = default_config(model_type)
    want = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), jax_loop._params(config, seeded_weights(config)))
    got = qwen_shape.jax_pattern_params(config, jax.devices("cpu")[0], jnp.bfloat16)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    shapes = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), got, want)
    assert all(jax.tree.leaves(shapes))
