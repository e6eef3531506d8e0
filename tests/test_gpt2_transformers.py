"""The GPT-2 decode loops (torch and JAX) against transformers' own ``GPT2LMHeadModel`` (CPU tier).

Per case (``helpers.gpt2_hf.CASES``): a random model made and saved by transformers, read back
through ``trace_replay_app.checkpoint``; traced tokens are the trace; untraced greedy requests
equal ``generate(do_sample=False)``; every logprob within :data:`ATOL` of transformers'
teacher-forced forward (float32); ranks and argmax those of its logits wherever a gap above
``RANK_EPS`` decides them (``llama_cases.check_against_hf``). A negative control: the same
check refuses a loop fed the weights without one bias.

The tolerance, derived: both sides compute float32 logits of magnitude |x| <= ~3 here through
the same operations in another order; each of the ~n_layer x 10 reductions (dot products of 48
to 256 terms, layer norms, softmaxes) rounds with relative error 2**-24 per term, which adds
up to a few float32 ulps of |x| per logit, and a logprob ``x_t - logsumexp(x)`` adds the error
of two of them. 32 ulps at |x| = 4 (2**-21 each) is 1.5e-5; measured: 1.0e-6 worst on this
CPU. The smallest planted fault (one bias dropped) moves logprobs by 1e-2 or more.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.gpt2_hf import CASES, load, make_checkpoint  # noqa: E402
from helpers.llama_cases import check_against_hf, hf_model, make_requests, teacher_forced  # noqa: E402

from trace_replay_app.models.gpt2 import jax_loop, torch_loop  # noqa: E402

LOOPS = {"torch": torch_loop.run_decode, "jax": jax_loop.run_decode}
ATOL = 32 * 2.0**-21  # 1.5e-5: see the module docstring


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (config, weights, transformers' model), made once per module."""
    out = {}
    for i, case in enumerate(sorted(CASES)):
        folder = make_checkpoint(case, str(tmp_path_factory.mktemp(case)), seed=10 + i)
        config, weights = load(folder)
        out[case] = (config, weights, hf_model(folder))
    return out


@pytest.mark.parametrize("framework", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(checkpoints, case, framework, rng):
    config, weights, model = checkpoints[case]
    assert config.vocab_size == CASES[case]["vocab_size"] and config.n_layer == CASES[case]["n_layer"]
    requests = make_requests(rng, config.vocab_size, n=6, longest=config.n_positions // 2)
    results = LOOPS[framework](config, weights, requests, max_batch=3)
    check_against_hf(model, requests, results, f"{case} {framework}", atol=ATOL)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_a_dropped_bias_is_caught(checkpoints, framework, rng):
    """Negative control: the check fails when the loop runs without the first MLP bias."""
    config, weights, model = checkpoints["gpt2-small"]
    broken = dict(weights)
    broken["h.0.mlp.c_fc.bias"] = np.zeros_like(weights["h.0.mlp.c_fc.bias"])
    requests = [r for r in make_requests(rng, config.vocab_size, n=6, longest=24) if r.trace is not None]
    results = LOOPS[framework](config, broken, requests, max_batch=3)
    moved = max(
        np.abs(res.logprobs - teacher_forced(model, r.prompt, r.trace)[0]).max() for r, res in zip(requests, results)
    )
    assert moved > 10 * ATOL, f"dropping a bias moved logprobs by {moved:.3g} only"
    with pytest.raises(AssertionError, match="logprob off by"):
        check_against_hf(model, requests, results, f"gpt2 {framework} without a bias", atol=ATOL)
