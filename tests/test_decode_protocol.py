"""The decode drivers' model protocols (``decode_model`` in both drivers), on the CPU.

- Every registry family, driven through the protocol (its model from ``TorchFamily.model`` /
  ``JaxFamily.model`` into ``decode_model``), gives the bits of its ``run_decode``: tokens,
  forced, logprobs, ranks and argmax, traced and untraced requests, with sampling.
- Models of a test's own (``helpers.decode_doubles``: arithmetic a test predicts exactly, a
  cache that lives on the torch model, an int32 cache array in JAX) decode what the
  reference says, through both drivers, across batch sizes; their caches are theirs.
- Refusals name the argument: a model without a method, bad limits, requests beyond them, an
  unhashable JAX model, a run that does not fit in memory.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.decode_doubles import N_POSITIONS, PARAMS, VOCAB, SumJax, SumTorch, reference

from trace_replay_app import TraceRequest, families
from trace_replay_app.drivers import jax_driver, torch_driver
from trace_replay_app.records import DeviceMemoryError

FIELDS = ("tokens", "forced", "logprobs", "ranks", "argmax")


@pytest.fixture(autouse=True)
def _torch_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _requests(rng, vocab: int, n: int = 6, longest: int = 10) -> list[TraceRequest]:
    out = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, 1 if i == 0 else int(rng.integers(1, longest))))
        k = int(rng.integers(1, longest))
        trace = tuple(int(t) for t in rng.integers(0, vocab, k)) if i % 2 else None
        out.append(TraceRequest(f"r{i}", prompt, trace, 0 if trace else k))
    return out


def _same_bits(a, b, what: str) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.id == y.id
        for field in FIELDS:
            u, v = getattr(x, field), getattr(y, field)
            assert u.dtype == v.dtype and u.tobytes() == v.tobytes(), f"{what}, request {x.id}: {field} differs"


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("family", [f.name for f in families()])
def test_registry_family_through_the_protocol_gives_the_bits_of_run_decode(family, framework, rng):
    fam = next(f for f in families() if f.name == family)
    config = fam.default_config()
    weights = fam.seeded_weights(config, int(rng.integers(2**31)))
    requests = _requests(rng, config.vocab_size)
    options = dict(max_batch=3, temperature=0.8, seed=int(rng.integers(2**31)))
    want = fam.run_decode(framework)(config, weights, requests, **options)
    if framework == "torch":
        spec = fam.load_loop("torch", "TORCH")
        model = spec.model(config, weights)
        got = torch_driver.decode_model(model, requests, prefill_tokens=spec.prefill_tokens, **options)
    else:
        model, params = fam.load_loop("jax", "JAX").model(config, weights)
        got = jax_driver.decode_model(model, params, requests, **options)
    _same_bits(want, got, f"{family} {framework}")
    assert any(r.trace is None and len(x.tokens) for r, x in zip(requests, got)) and any(x.forced.any() for x in got)


def _check_reference(requests, results, what: str) -> None:
    for r, res in zip(requests, results, strict=True):
        tokens, logprobs, argmax = reference(r.prompt, r.trace, r.new_tokens)
        assert res.tokens.tolist() == tokens.tolist(), f"{what}, request {r.id}: tokens"
        assert res.argmax.tolist() == argmax.tolist(), f"{what}, request {r.id}: argmax"
        np.testing.assert_allclose(res.logprobs, logprobs, rtol=0, atol=1e-5, err_msg=f"{what}, request {r.id}")
        assert res.forced.tolist() == [r.trace is not None] * r.new_tokens


@pytest.mark.parametrize("max_batch", [1, 3, 16])
def test_own_models_decode_what_the_reference_says(max_batch, rng) -> None:
    requests = _requests(rng, VOCAB, n=9, longest=12)
    torch_model = SumTorch()
    steps: list[int] = []
    a = torch_driver.decode_model(torch_model, requests, max_batch=max_batch, on_step=steps.append, prefill_tokens=7)
    b = jax_driver.decode_model(SumJax(), PARAMS, requests, max_batch=max_batch)
    _check_reference(requests, a, f"torch, max_batch {max_batch}")
    _check_reference(requests, b, f"jax, max_batch {max_batch}")
    assert torch_model.calls["new_cache"] == 1 and torch_model.calls["decode"] == len(steps)
    assert sum(steps) == sum(r.new_tokens for r in requests)


def test_a_run_without_steps_builds_no_cache():
    model = SumTorch()
    (empty,) = torch_driver.decode_model(model, [TraceRequest("a", (1, 2))])
    assert empty.tokens.shape == (0,) and model.calls == {"new_cache": 0, "prefill": 0, "decode": 0}
    assert jax_driver.decode_model(SumJax(), PARAMS, []) == []


class _NoDecode:
    vocab_size, n_positions = VOCAB, N_POSITIONS

    def new_cache(self, slots, kv_len):
        return None

    def prefill(self, cache, slots, tokens):
        return None


class _Limits(SumTorch):
    def __init__(self, vocab_size, n_positions):
        super().__init__()
        self.vocab_size, self.n_positions = vocab_size, n_positions


class _Unhashable(SumJax):
    __hash__ = None  # type: ignore[assignment]


REQUEST = [TraceRequest("a", (1, 2), (3, 4))]
REFUSALS = {
    "no decode": (
        lambda: torch_driver.decode_model(_NoDecode(), REQUEST),  # type: ignore[arg-type]
        TypeError,
        r"^model must have a callable decode\(\) \(a TorchDecodeModel; got a _NoDecode\)$",
    ),
    "vocab not an int": (
        lambda: torch_driver.decode_model(_Limits(3.5, 8), REQUEST),
        TypeError,
        r"^model\.vocab_size must be an int >= 1 \(got 3\.5 from a _Limits\)$",
    ),
    "no positions": (
        lambda: torch_driver.decode_model(_Limits(VOCAB, 0), REQUEST),
        TypeError,
        r"^model\.n_positions must be an int >= 1 \(got 0 from a _Limits\)$",
    ),
    "token beyond the vocabulary": (
        lambda: torch_driver.decode_model(_Limits(4, 8), REQUEST),
        ValueError,
        r"^requests\[0\] \(id 'a'\): trace\[1\]=4 is outside \[0, vocab_size=4\)$",
    ),
    "request too long": (
        lambda: jax_driver.decode_model(SumJax(n_positions=3), PARAMS, REQUEST),
        ValueError,
        r"^requests\[0\] \(id 'a'\): prompt \(2 tokens\) \+ 2 new tokens = 4 exceeds model\.n_positions=3$",
    ),
    "unhashable jax model": (
        lambda: jax_driver.decode_model(_Unhashable(), PARAMS, REQUEST),
        TypeError,
        r"^model must be hashable: it is a static argument of jitted programs",
    ),
    "prefill_tokens": (
        lambda: torch_driver.decode_model(SumTorch(), REQUEST, prefill_tokens=0),
        ValueError,
        r"^prefill_tokens must be an int >= 1 \(got 0\)$",
    ),
    "max_batch": (
        lambda: jax_driver.decode_model(SumJax(), PARAMS, REQUEST, max_batch=0),
        ValueError,
        r"^max_batch must be an int >= 1 \(got 0\)$",
    ),
    "cuda_graph on the cpu": (
        lambda: torch_driver.decode_model(SumTorch(), REQUEST, cuda_graph=True),
        ValueError,
        r"^cuda_graph=True needs a CUDA device \(got device='cpu'\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_argument(case):
    call, kind, pattern = REFUSALS[case]
    with pytest.raises(kind, match=pattern):
        call()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_run_that_does_not_fit_is_refused(framework, monkeypatch):
    driver = torch_driver if framework == "torch" else jax_driver
    monkeypatch.setattr(driver, "free_bytes", lambda device: 16)
    model = SumTorch()
    with pytest.raises(DeviceMemoryError, match=re.escape("on cpu, which has 0.0 MiB free")) as info:
        if framework == "torch":
            driver.decode_model(model, REQUEST)
        else:
            driver.decode_model(SumJax(), PARAMS, REQUEST)
    assert info.value.needed > 16 and model.calls["decode"] == 0
