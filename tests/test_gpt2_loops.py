"""The GPT-2 decode loops (both frameworks) against the float64 forward, each other and batch sizes:
the checks and the tolerance are in ``helpers/gpt2_cases.py``, whose docstring derives them."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from helpers.gpt2_cases import (  # noqa: E402, F401 (small_jax_chunks, torch_one_thread: autouse fixtures)
    CONFIG,
    LOOPS,
    _docstring_example,
    check_against_reference,
    check_batch_sizes,
    check_matches_reference,
    check_torch_vs_jax,
    check_untraced_unaffected,
    make_requests,
    small_jax_chunks,
    torch_one_thread,
    weights_for,
)

import trace_replay_app.models.gpt2.jax_loop as jax_gpt2  # noqa: E402
import trace_replay_app.models.gpt2.torch_loop as torch_gpt2  # noqa: E402
import trace_replay_app.schedule as schedule_module  # noqa: E402
from trace_replay_app.models.gpt2 import reference_logits  # noqa: E402
from trace_replay_app.records import TraceRequest  # noqa: E402
from trace_replay_app.schedule import plan  # noqa: E402


# -- CPU tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["seeded", "scaled"])
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_matches_reference(framework, kind, rng):
    check_matches_reference(LOOPS[framework], "cpu", rng, kind)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_untraced_unaffected_by_traced_neighbours(framework, rng):
    check_untraced_unaffected(LOOPS[framework], "cpu", rng)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_continuous_batching_across_batch_sizes(framework, rng):
    check_batch_sizes(LOOPS[framework], "cpu", rng)


def test_torch_vs_jax(rng):
    check_torch_vs_jax("cpu", rng)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_requests_without_new_tokens(framework, rng):
    """A request with no new tokens gets empty results and takes no slot; no request, no step."""
    run, weights = LOOPS[framework], weights_for(rng)
    prompt = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, 3))
    calls = []
    assert run(CONFIG, weights, [], on_step=calls.append) == []
    (empty,) = run(CONFIG, weights, [TraceRequest("a", prompt)], on_step=calls.append)
    assert calls == [] and empty.id == "a"
    assert empty.tokens.shape == empty.logprobs.shape == (0,) and empty.logprobs.dtype == np.float32
    requests = make_requests(rng, 3)
    requests.insert(1, TraceRequest("none", prompt))
    results = run(CONFIG, weights, requests, max_batch=3, on_step=calls.append)
    assert sum(calls) == sum(r.new_tokens for r in requests)
    check_against_reference(weights, requests, results, framework)


@pytest.mark.parametrize("module", [torch_gpt2, jax_gpt2], ids=["torch", "jax"])
def test_module_examples_run(module):
    """The example in each loop's module docstring runs as written, and so do the schedule's."""
    namespace = {}
    exec(compile(_docstring_example(module), f"{module.__name__} docstring", "exec"), namespace)
    assert namespace["b"].tokens.shape == (5,) and not namespace["b"].forced.any()
    assert doctest.testmod(schedule_module).failed == 0


def test_schedule_rules(rng):
    counts = rng.integers(0, 6, 40)
    for max_batch in (1, 3, 8):
        s = plan(counts, max_batch)
        live = np.nonzero(counts > 0)[0]
        assert (s.slot[counts == 0] == -1).all() and (s.slot[live] >= 0).all()
        assert (np.diff(s.start[live]) >= 0).all(), "admitted out of input order"
        busy = np.zeros((s.n_steps, max_batch), dtype=int)
        for i in live:
            busy[s.start[i] : s.start[i] + counts[i], s.slot[i]] += 1
            np.testing.assert_array_equal(s.outputs(i, s.idx_mapping), np.full(counts[i], s.slot[i]))
        assert busy.max() == 1, "two requests share a slot at one step"
        np.testing.assert_array_equal(s.idx_mapping >= 0, busy == 1)
        for prev, i in itertools.pairwise(live):  # nobody waits while a slot is free
            if s.start[i] > s.start[prev]:
                assert busy[s.start[i] - 1].all(), f"request {i} waited for a slot with one free"
        for step in range(s.n_steps):
            assert set(s.admitted(step).tolist()) == set(live[s.start[live] == step].tolist())
        prompt_lens = rng.integers(1, 30, counts.size)
        assert s.kv_positions(prompt_lens) == max(prompt_lens[i] + counts[i] - 1 for i in live)
    assert plan([], 4).n_steps == 0 and plan([0, 0], 4).n_steps == 0


def test_reference_logits_is_causal(rng):
    weights = weights_for(rng)
    tokens = rng.integers(0, CONFIG.vocab_size, 20)
    full = reference_logits(CONFIG, weights, tokens)
    assert full.shape == (20, CONFIG.vocab_size) and full.dtype == np.float64
    np.testing.assert_allclose(reference_logits(CONFIG, weights, tokens[:7]), full[:7], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"^tokens\[1\]=512 is outside \[0, vocab_size=512\)$"):
        reference_logits(CONFIG, weights, [3, 512])


@pytest.mark.parametrize(
    "dtype, flash, error, match",
    [
        ("bfloat16", True, ValueError, r"flash=True needs a CUDA device.*got device=cpu, dtype=torch.bfloat16"),
        ("float32", 1, TypeError, r"flash must be None, True or False \(got 1\)"),
    ],
)
def test_flash_decode_refused_where_it_cannot_run(dtype, flash, error, match, rng):
    import torch

    dt, weights = getattr(torch, dtype), weights_for(rng)
    with pytest.raises(error, match=match):
        torch_gpt2.GPT2Torch(CONFIG, weights, torch.device("cpu"), dt, flash=flash)
    assert not torch_gpt2.GPT2Torch(CONFIG, weights, torch.device("cpu"), dt).flash  # masked on the CPU
