"""The Llama-family JAX loop on a 2-device mesh, run by ``test_multi_device.py`` in a subprocess.

JAX fixes its CPU device count when it is first imported, so these run in a process of their
own started with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu``. Run them directly with::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m pytest -q -p no:cacheprovider tests/jax_mesh_loop_cases.py

Per model: ``jax_mesh.run_decode_mesh`` with the output projection sharded over a 2-device
``vocab`` axis against ``jax_loop.run_decode`` on one device (tokens and ranks equal,
logprobs within 1e-5 in float32), greedy and sampled; the logits really are sharded.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import Mesh  # noqa: E402

from trace_replay_app.models.llama import jax_loop  # noqa: E402
from trace_replay_app.models.llama.config import LlamaConfig, default_config, seeded_weights  # noqa: E402
from trace_replay_app.models.llama.jax_mesh import run_decode_mesh  # noqa: E402

try:
    from llama_cases import check_same, make_requests
except ImportError:  # tests/ collected as a package
    from tests.llama_cases import check_same, make_requests

DEVICES = 2
if len(jax.devices("cpu")) < DEVICES:
    pytest.skip(f"needs {DEVICES} CPU host devices: run through tests/test_multi_device.py (it sets "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX starts)",
                allow_module_level=True)

# Tied (a sharded copy of the embedding as the head) and untied heads; biases, a sliding window.
CONFIGS = {"qwen2-tied": default_config("qwen2"),
           "llama-untied": LlamaConfig(model_type="llama", vocab_size=510, tie_word_embeddings=False, o_bias=True,
                                       mlp_bias=True, layer_windows=(0, 5))}


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("vocab",))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mesh_loop_equals_one_device(name, rng):
    config = CONFIGS[name]
    weights = seeded_weights(config, seed=int(rng.integers(2**31)))
    requests = make_requests(rng, config.vocab_size, n=5, longest=16)
    ref = jax_loop.run_decode(config, weights, requests, max_batch=3)
    got = run_decode_mesh(config, weights, requests, mesh=_mesh(), max_batch=3)
    check_same(got, ref, f"{name}: 2-device mesh vs one device", atol=1e-5)
    for a, b in zip(got, ref):
        assert a.argmax.tolist() == b.argmax.tolist(), f"{name}, request {a.id}: argmax differs"


def test_sampled_tokens_equal_one_device(rng):
    config = CONFIGS["qwen2-tied"]
    weights = seeded_weights(config, seed=3)
    requests = make_requests(rng, config.vocab_size, n=5, longest=16)   # the buckets of the greedy case
    ref = jax_loop.run_decode(config, weights, requests, max_batch=3, temperature=1.3, seed=5)
    got = run_decode_mesh(config, weights, requests, mesh=_mesh(), max_batch=3, temperature=1.3, seed=5)
    check_same(got, ref, "sampled on the mesh", atol=1e-5)


def test_logits_are_sharded_over_the_vocabulary(rng):
    import jax.numpy as jnp
    from trace_replay_app.models.llama.jax_mesh import placed_params
    config = CONFIGS["qwen2-tied"]
    params = placed_params(config, seeded_weights(config), _mesh(), "vocab", jnp.float32)
    half = config.vocab_size // DEVICES
    assert {s.data.shape for s in params["head"].addressable_shards} == {(config.hidden_size, half)}
    assert {s.data.shape for s in params["embed"].addressable_shards} == {(config.vocab_size, config.hidden_size)}
    h = jnp.asarray(rng.standard_normal((3, config.hidden_size)), jnp.float32)
    logits = jax.jit(jax_loop._logits)(params, h)
    assert {s.data.shape for s in logits.addressable_shards} == {(3, half)}
    np.testing.assert_allclose(np.asarray(logits), np.asarray(h) @ np.asarray(params["embed"]).T, rtol=1e-5,
                               atol=1e-5)


def test_refusals():
    config = CONFIGS["qwen2-tied"]
    weights = seeded_weights(config)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        run_decode_mesh(config, weights, [], mesh="cpu")
    with pytest.raises(ValueError, match="vocab_axis must be one of"):
        run_decode_mesh(config, weights, [], mesh=_mesh(), vocab_axis="batch")
    odd = LlamaConfig(model_type="qwen2", vocab_size=509)
    with pytest.raises(ValueError, match="vocab_size=509 does not split evenly"):
        run_decode_mesh(odd, seeded_weights(odd), [], mesh=_mesh())
