"""Parity of a PyTorch model and its hand-written JAX port, on trace-replay's decode drivers.

``tiny_model.TinyTorch`` (two layers, rotary positions, its own KV cache layout) and
``tiny_port.TinyJax`` (the port: pure functions, another cache layout) are nobody's registry
family: they keep the drivers' decode protocols and go straight to
:func:`trace_replay_app.parity.run_parity`. Run from the repository's root::

    pytest examples/parity                        # CPU (GPU cases skip without a GPU)
    pytest examples/parity -m gpu                 # on a GPU: float32 and bfloat16 on CUDA
    pytest examples/parity --trace-replay-traces traces.jsonl --trace-replay-report-dir parity-reports

- ``test_port_matches_the_model``: each trace set of the plugin's ``trace_set`` fixture
  (random, ties, long; a file with ``--trace-replay-traces``) through both models, compared
  with :func:`~trace_replay_app.parity.assert_parity` at the compute dtype's default tolerance
  (float32 on the CPU; float32 and bfloat16 on a GPU).
- ``test_planted_rotary_bug_is_caught``: a port that reads the rotary base wrong (500000,
  Llama 3's, for the model's 10000) fails, and the failure names where: a request whose prompt
  is one token first parts at position 1, since at position 0 the query and its only key sit
  at position 0, which every rotary base leaves unrotated; a request with a longer prompt
  parts at position 0. In bfloat16 the per-position bound is looser than the first
  differences, so there the mean fails, and position 0 is never named for the one-token prompt.
  The same requests through the right port pass, in each dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
import torch
from tiny_model import TinyConfig, TinyTorch
from tiny_port import TinyJax, port_params

from trace_replay_app import TraceRequest
from trace_replay_app.parity import ParityError, assert_parity, run_parity

CONFIG = TinyConfig()


def _has_cuda() -> bool:
    try:
        return torch.cuda.is_available() and bool(jax.devices("cuda"))
    except RuntimeError:  # JAX's CPU build: no cuda backend
        return False


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU seen by torch and JAX")]
CPU_FLOAT32 = pytest.param("cpu", "float32", id="cpu-float32")
CPU_BFLOAT16 = pytest.param("cpu", "bfloat16", id="cpu-bfloat16")
GPU = [
    pytest.param("cuda", "float32", id="cuda-float32", marks=_GPU),
    pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=_GPU),
]


@pytest.fixture(autouse=True)
def _torch_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only synchronise
    yield
    torch.set_num_threads(threads)


def _models(device: str, dtype: str, rope_base: float | None = None):
    """The torch model, the port and the port's parameters (their rotary frequencies from
    another base if given)."""
    model = TinyTorch(CONFIG, seed=0, device=device, dtype=getattr(torch, dtype))
    config = CONFIG if rope_base is None else dataclasses.replace(CONFIG, rope_base=rope_base)
    return model, TinyJax(CONFIG, dtype), port_params(model.state_numpy(), config, dtype)


@pytest.mark.parametrize("device, dtype", [CPU_FLOAT32, *GPU])
def test_port_matches_the_model(trace_set, device, dtype):
    requests = trace_set.requests(CONFIG.vocab_size, CONFIG.n_positions)
    model, port, params = _models(device, dtype)
    run = run_parity(model, port, params, requests, device=device, max_batch=4)
    assert_parity(run.a, run.b, requests=run.requests, dtype=dtype)
    for request, result in zip(requests, run.a):
        if request.trace is not None:
            assert result.tokens.tolist() == list(request.trace)


@pytest.mark.parametrize("device, dtype", [CPU_FLOAT32, CPU_BFLOAT16, *GPU])
def test_planted_rotary_bug_is_caught(device, dtype):
    requests = [
        TraceRequest("one-token-prompt", (5,), tuple(range(10, 30))),
        TraceRequest("prompt-of-8", tuple(range(40, 48)), tuple(range(60, 80))),
    ]
    model, port, params = _models(device, dtype, rope_base=500000.0)
    run = run_parity(model, port, params, requests, device=device, max_batch=2)
    with pytest.raises(ParityError) as failed:
        assert_parity(run.a, run.b, requests=run.requests, dtype=dtype)
    first = {f["id"]: f["first_divergent_position"] for f in failed.value.failures}
    message = str(failed.value)
    if dtype == "float32":
        assert first == {"one-token-prompt": 1, "prompt-of-8": 0}, message
        assert "request 'one-token-prompt' (traced, prompt of 1 token): first divergent position 1" in message
    else:
        assert "mean |d|" in message and first.get("one-token-prompt", 1) >= 1, message
    _, port, params = _models(device, dtype)  # the same requests through the right port pass
    fixed = run_parity(model, port, params, requests, device=device, max_batch=2)
    assert_parity(fixed.a, fixed.b, requests=fixed.requests, dtype=dtype)
