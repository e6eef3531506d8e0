"""The JAX driver on a 2-device mesh, run by ``test_multi_device.py`` in a subprocess.

JAX fixes its CPU device count when it is first imported, so these run in a process of their
own started with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu``. Run them directly with::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m pytest -q -p no:cacheprovider tests/jax_mesh_loop_cases.py

With ``TRACE_REPLAY_MESH_PLATFORM=gpu`` (``tests/test_gpu_multi.py`` sets it) the same cases run
on the first two GPUs against the loop on ``cuda:0``, in float32 and bfloat16.

Per model: a family's JAX ``run_decode(..., mesh=)`` with the output projection sharded over a
2-device ``vocab`` axis against the same ``run_decode`` on one device (tokens equal, logprobs
within 1e-5 in float32, ranks and argmax those of transformers' logits wherever no near-tie
leaves them open), greedy and sampled; the logits really are sharded.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from helpers.llama_cases import check_same, hf_reference, make_requests  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from trace_replay_app.drivers.jax_driver import placed_params, sharded_argmax  # noqa: E402
from trace_replay_app.models.gpt2 import GPT2Config  # noqa: E402
from trace_replay_app.models.gpt2 import jax_loop as gpt2_jax  # noqa: E402
from trace_replay_app.models.gpt2 import seeded_weights as gpt2_weights  # noqa: E402
from trace_replay_app.models.llama import jax_loop  # noqa: E402
from trace_replay_app.models.llama.config import LlamaConfig, default_config, seeded_weights  # noqa: E402

DEVICES = 2
PLATFORM = os.environ.get("TRACE_REPLAY_MESH_PLATFORM", "cpu")  # "cpu" or "gpu"
ONE_DEVICE = "cpu" if PLATFORM == "cpu" else "cuda:0"
DTYPES = {"float32": 1e-5} if PLATFORM == "cpu" else {"float32": 2e-5, "bfloat16": 2e-2}
try:
    _FOUND = len(jax.devices(PLATFORM))
except RuntimeError:
    _FOUND = 0
if _FOUND < DEVICES:
    pytest.skip(
        f"needs {DEVICES} {PLATFORM} devices (found {_FOUND}): run through tests/test_multi_device.py "
        f"(it sets XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX starts) or "
        f"tests/test_gpu_multi.py on a machine with 2 GPUs",
        allow_module_level=True,
    )

# Tied (a sharded copy of the embedding as the head) and untied heads, biases; both expressible
# in transformers, whose logits decide the ranks where two tokens nearly tie.
CONFIGS = {
    "qwen2-tied": default_config("qwen2"),
    "llama-untied": LlamaConfig(
        model_type="llama", vocab_size=510, tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True
    ),
}


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices(PLATFORM)[:DEVICES]), ("vocab",))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mesh_loop_equals_one_device(name, dtype, rng, tmp_path):
    config = CONFIGS[name]
    weights = seeded_weights(config, seed=int(rng.integers(2**31)))
    requests = make_requests(rng, config.vocab_size, n=5, longest=16)
    if dtype != "float32":  # bf16: the traced requests (free decoding may part on a bf16 tie)
        requests = [r for r in requests if r.trace is not None]
    ref = jax_loop.run_decode(config, weights, requests, device=ONE_DEVICE, max_batch=3, dtype=dtype)
    got = jax_loop.run_decode(config, weights, requests, mesh=_mesh(), max_batch=3, dtype=dtype)
    if dtype == "float32":
        check_same(
            got,
            ref,
            f"{name}: 2-device mesh vs one device",
            atol=DTYPES[dtype],
            reference=hf_reference(config, weights, str(tmp_path / name)),
            requests=requests,
        )
    else:  # bf16 logits of another GEMM shape may differ in the last bit
        for a, b in zip(got, ref, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist(), f"{name} bf16, request {a.id}: tokens differ"
            diff = np.abs(a.logprobs - b.logprobs).max()
            assert diff <= DTYPES[dtype], f"{name} bf16, request {a.id}: logprobs differ by {diff:.3g}"


def test_sampled_tokens_equal_one_device(rng, tmp_path):
    config = CONFIGS["qwen2-tied"]
    weights = seeded_weights(config, seed=3)
    requests = make_requests(rng, config.vocab_size, n=5, longest=16)  # the buckets of the greedy case
    ref = jax_loop.run_decode(config, weights, requests, device=ONE_DEVICE, max_batch=3, temperature=1.3, seed=5)
    got = jax_loop.run_decode(config, weights, requests, mesh=_mesh(), max_batch=3, temperature=1.3, seed=5)
    check_same(
        got,
        ref,
        "sampled on the mesh",
        atol=DTYPES["float32"],
        reference=hf_reference(config, weights, str(tmp_path / "qwen2")),
        requests=requests,
    )


def test_logits_are_sharded_over_the_vocabulary(rng):
    import jax.numpy as jnp

    config = CONFIGS["qwen2-tied"]
    params = placed_params(jax_loop.JAX, config, seeded_weights(config), _mesh(), "vocab", jnp.float32)
    half = config.vocab_size // DEVICES
    assert {s.data.shape for s in params["head"].addressable_shards} == {(config.hidden_size, half)}
    assert {s.data.shape for s in params["embed"].addressable_shards} == {(config.vocab_size, config.hidden_size)}
    h = jnp.asarray(rng.standard_normal((3, config.hidden_size)), jnp.float32)
    logits = jax.jit(lambda p, x: x @ p["head"])(params, h)
    assert {s.data.shape for s in logits.addressable_shards} == {(3, half)}
    np.testing.assert_allclose(np.asarray(logits), np.asarray(h) @ np.asarray(params["embed"]).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [2, 10, 510])
def test_sharded_argmax_takes_the_lowest_id_on_ties(vocab, rng):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    x = rng.integers(0, 4, (33, vocab)).astype(np.float32)  # many ties, across the blocks too
    x[0] = 1.0  # a row of equal values
    got = jax.jit(lambda a: sharded_argmax(a, mesh, "vocab"))(jax.device_put(x, NamedSharding(mesh, P(None, "vocab"))))
    assert np.asarray(got).tolist() == x.argmax(axis=-1).tolist()


def test_refusals():
    config = CONFIGS["qwen2-tied"]
    weights = seeded_weights(config)
    with pytest.raises(TypeError, match=r"^mesh must be a jax.sharding.Mesh or None \(got str\)"):
        jax_loop.run_decode(config, weights, [], mesh="cpu")
    with pytest.raises(ValueError, match="^vocab_axis must be one of"):
        jax_loop.run_decode(config, weights, [], mesh=_mesh(), vocab_axis="batch")
    with pytest.raises(ValueError, match=r"^device must be left at 'cpu' when a mesh is given \(got device='cuda'\)"):
        jax_loop.run_decode(config, weights, [], mesh=_mesh(), device="cuda")
    odd = LlamaConfig(model_type="qwen2", vocab_size=509)
    with pytest.raises(ValueError, match="vocab_size=509 does not split evenly"):
        jax_loop.run_decode(odd, seeded_weights(odd), [], mesh=_mesh())


def test_gpt2_on_the_mesh_equals_one_device(rng):
    """The mesh is an option of the driver: GPT-2 gets it too (its tied head sharded)."""
    config = GPT2Config(vocab_size=510)
    weights = gpt2_weights(config, seed=int(rng.integers(2**31)))
    requests = [r for r in make_requests(rng, config.vocab_size, n=6, longest=16) if r.trace is not None]
    ref = gpt2_jax.run_decode(config, weights, requests, device=ONE_DEVICE, max_batch=3)
    got = gpt2_jax.run_decode(config, weights, requests, mesh=_mesh(), max_batch=3)
    for a, b in zip(got, ref, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist(), f"gpt2 request {a.id}: tokens differ"
        diff = np.abs(a.logprobs - b.logprobs).max()
        assert diff <= DTYPES["float32"], f"gpt2 request {a.id}: logprobs differ by {diff:.3g}"
