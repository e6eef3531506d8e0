"""The JAX driver's batched prefill: the prompts admitted at one step that share a bucket size go
through one vmapped prefill program (families that opt in: the Llama family), with the results
of one program per prompt up to float32 rounding; the GPT-2 family and user models by default
keep one program per prompt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import trace_replay_app.drivers.jax_steps as jax_steps
from trace_replay_app.drivers.jax_driver import JaxModel, decoder
from trace_replay_app.drivers.jax_steps import PREFILL_SCORES, prefill_groups
from trace_replay_app.models.llama.config import default_config, seeded_weights
from trace_replay_app.models.llama.jax_loop import JAX
from trace_replay_app.records import TraceRequest


@pytest.mark.parametrize(
    "buckets, limit, want",
    [
        ([8, 16, 8, 8, 16], 64, [[0, 2, 3], [1, 4]]),  # by bucket, in order of first appearance
        ([8] * 5, 4, [[0, 1, 2, 3], [4]]),  # at most `limit`
        ([8] * 5, 3, [[0, 1], [2, 3], [4]]),  # the most a power of two
        ([4096, 4096], 64, [[0], [1]]),  # 4096 ** 2 scores per head: one prompt per program
        ([], 64, []),
    ],
)
def test_prefill_groups(buckets, limit, want):
    assert prefill_groups(buckets, limit) == want
    for group in prefill_groups(buckets, limit):
        assert len(group) * buckets[group[0]] ** 2 <= max(PREFILL_SCORES, buckets[group[0]] ** 2)


# The first eight prompts' lengths (the first admission at max_batch=8): prefill buckets 8, 16,
# 32, 8, 16, 32, 16, 32, so one group of two (a power of two: no padding entry) and two of three
# (padded to four with their first entry).
FIRST = (5, 12, 20, 9, 14, 25, 16, 29)


def _requests(config, n, rng):
    return [
        TraceRequest(
            str(i),
            prompt=tuple(
                rng.integers(0, config.vocab_size, FIRST[i] if i < len(FIRST) else rng.integers(2, 30)).tolist()
            ),
            trace=tuple(rng.integers(0, config.vocab_size, 5).tolist()) if i % 2 else None,
            max_new_tokens=6,
        )
        for i in range(n)
    ]


@pytest.fixture
def group_calls(monkeypatch):
    """The sizes of the batched prefill programs a run calls."""
    sizes: list[int] = []
    real = jax_steps._prefill_group

    def counting(params, prefixes, *, model):
        sizes.append(int(prefixes.shape[0]))
        return real(params, prefixes, model=model)

    monkeypatch.setattr(jax_steps, "_prefill_group", counting)
    return sizes


def test_batched_prefill_gives_the_results_of_one_program_per_prompt(group_calls, rng):
    config = default_config("qwen2")
    weights = seeded_weights(config)
    requests = _requests(config, 12, rng)
    grouped = decoder(JAX)(config, weights, requests, max_batch=8)
    assert group_calls[:3] == [2, 4, 4], group_calls  # in order of the buckets' first appearance
    assert all(size & (size - 1) == 0 and size > 1 for size in group_calls)
    group_calls.clear()
    alone = decoder(dataclasses.replace(JAX, batched_prefill=False))(config, weights, requests, max_batch=8)
    assert group_calls == []
    for a, b in zip(grouped, alone):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=a.id)
        np.testing.assert_array_equal(a.forced, b.forced, err_msg=a.id)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=2e-6, err_msg=a.id)


def test_models_keep_one_program_per_prompt_unless_they_opt_in(group_calls, rng):
    from trace_replay_app.models.gpt2 import config as gpt2_config
    from trace_replay_app.models.gpt2.jax_loop import run_decode as gpt2_run

    config = gpt2_config.GPT2Config()
    requests = _requests(config, 6, rng)
    gpt2_run(config, gpt2_config.seeded_weights(config), requests, max_batch=6)
    assert group_calls == []  # GPT-2 (the demo's family): each prompt's own program, as in torch
    model = JaxModel(1, 1, *(lambda *a: None,) * 4)
    assert model.batched_prefill is False
