"""``run_score`` (teacher-forced, the trainer's view) of every family in both frameworks, on the CPU.

Per family case, transformers' own tiny model is the reference: every completion token's
logprob within 1e-5 of transformers' teacher-forced forward (float32; GPT-2 within its loops'
1.5e-5), ranks and argmax those of its logits wherever a gap above ``RANK_EPS`` decides them;
the same tokens decoded with replay (``run_decode``) agree within the same bound; batches cut
by ``max_tokens`` and chunks of ``chunk_rows`` change no bit; bad calls are refused naming the
argument. A planted fault (the completion scored one position late) is caught.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
from helpers.gpt2_hf import CASES as GPT2_CASES  # noqa: E402
from helpers.gpt2_hf import load as gpt2_load  # noqa: E402
from helpers.gpt2_hf import make_checkpoint as gpt2_checkpoint  # noqa: E402
from helpers.llama_cases import (  # noqa: E402
    CASES,
    check_against_hf,
    check_same,
    check_top_k_against_hf,
    hf_model,
    load,
    make_checkpoint,
    make_completions,
    reference_logits,
)

from trace_replay_app import scoring  # noqa: E402
from trace_replay_app.models.gpt2 import torch_loop as gpt2_torch  # noqa: E402
from trace_replay_app.models.llama import torch_loop  # noqa: E402
from trace_replay_app.records import TraceRequest  # noqa: E402

HAS_JAX = importlib.util.find_spec("jax") is not None
SCORE = {("llama", "torch"): torch_loop.run_score, ("gpt2", "torch"): gpt2_torch.run_score}
DECODE = {("llama", "torch"): torch_loop.run_decode, ("gpt2", "torch"): gpt2_torch.run_decode}
if HAS_JAX:  # only a missing jax skips the JAX cases: an import error in our own loop fails here
    from trace_replay_app.models.gpt2 import jax_loop as gpt2_jax
    from trace_replay_app.models.llama import jax_loop

    SCORE.update({("llama", "jax"): jax_loop.run_score, ("gpt2", "jax"): gpt2_jax.run_score})
    DECODE.update({("llama", "jax"): jax_loop.run_decode, ("gpt2", "jax"): gpt2_jax.run_decode})
FRAMEWORKS = sorted({fw for _, fw in SCORE})
GPT2_ATOL = 32 * 2.0**-21


# The Llama-family cases scored here: the layer math each model type adds is checked against
# transformers in decode (test_llama_loops.py, every case) and score runs the same layers, so
# the cases here are those that reach each branch of score's own prefill attention (windows,
# biases, q/k norms, tied heads) plus Gemma 2's (soft-capped scores and logits, norms on both
# sides, a query scale of its own).
SCORE_CASES = ["gemma2-softcap", "llama-tied-llama3-sharded", "llama-untied-llama3-biases", "mistral-window-bf16"]
SCORE_CASES += ["qwen2", "qwen3"]
assert set(SCORE_CASES) <= set(CASES)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (family, config, weights, transformers' model); the Llama cases and one GPT-2."""
    out = {}
    for i, case in enumerate(SCORE_CASES):
        folder = make_checkpoint(case, str(tmp_path_factory.mktemp(case)), seed=20 + i)
        out[case] = ("llama", *load(folder), hf_model(folder))
    folder = gpt2_checkpoint("gpt2-odd", str(tmp_path_factory.mktemp("gpt2")), seed=30)
    out["gpt2-odd"] = ("gpt2", *gpt2_load(folder), hf_model(folder))
    assert "gpt2-odd" in GPT2_CASES
    return out


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", SCORE_CASES + ["gpt2-odd"])
def test_matches_transformers_and_decode(models, case, framework, rng):
    family, config, weights, model = models[case]
    atol = GPT2_ATOL if family == "gpt2" else 1e-5
    requests = make_completions(rng, config.vocab_size)
    got = SCORE[family, framework](config, weights, requests, max_tokens=48, chunk_rows=7)
    check_against_hf(model, requests, got, f"{case} {framework} score", atol=atol)
    check_entropy(model, requests, got, f"{case} {framework} score")
    decoded = DECODE[family, framework](config, weights, requests, max_batch=3)
    check_same(got, decoded, f"{case} {framework} score vs decode", atol=atol, reference=model, requests=requests)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_batches_and_chunks_change_no_bit(models, framework, rng):
    family, config, weights, _ = models["qwen2"]
    requests = make_completions(rng, config.vocab_size, n=6)
    one = SCORE[family, framework](config, weights, requests, max_tokens=1, chunk_rows=1)
    many = SCORE[family, framework](config, weights, requests, max_tokens=4096, chunk_rows=4096)
    for a, b in zip(one, many, strict=True):
        assert a.id == b.id and a.tokens.tolist() == b.tokens.tolist() and a.forced.all()
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=2e-6, err_msg=a.id)
        assert (a.ranks == b.ranks).all() and (a.argmax == b.argmax).all(), a.id


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_top_k_is_that_of_transformers(models, framework, rng):
    """``top_k=5``: each position's five most likely ids are those of transformers' logits where
    a gap above ``RANK_EPS`` decides them, their logprobs within 1e-5, in order; the token's own
    logprob, rank and entropy are the same bits as without top-k."""
    family, config, weights, model = models["qwen2"]
    requests = make_completions(rng, config.vocab_size, n=4)
    k = 5
    got = SCORE[family, framework](config, weights, requests, top_k=k, chunk_rows=3)
    plain = SCORE[family, framework](config, weights, requests, chunk_rows=3)
    for r, res, base in zip(requests, got, plain, strict=True):
        assert base.topk_ids is None and base.topk_logprobs is None
        for name in ("logprobs", "ranks", "argmax", "entropy"):
            assert np.array_equal(getattr(res, name), getattr(base, name)), (r.id, name)
    check_top_k_against_hf(model, requests, got, k, f"{framework} score")
    assert all(res.topk_ids is not None and res.topk_ids[:, 0].tolist() == res.argmax.tolist() for res in got)


def check_entropy(model, requests, results, what: str) -> None:
    """Each scored position's entropy against transformers' float32 logits (float64 here)."""
    for r, res in zip(requests, results, strict=True):
        logits = reference_logits(model, r.prompt, list(r.trace)).astype(np.float64)
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        want = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
        assert res.entropy is not None and res.entropy.dtype == np.float32, what
        np.testing.assert_allclose(res.entropy, want, rtol=1e-4, atol=1e-5, err_msg=f"{what}, request {r.id}")


def test_a_late_completion_is_caught(models, rng, monkeypatch):
    """A planted fault: each completion token scored from the logits of its own position (one
    late) instead of the position before it fails the reference check."""
    family, config, weights, model = models["qwen3"]
    requests = make_completions(rng, config.vocab_size, n=3)
    plain = scoring._batch

    def late(reqs, members):
        b = plain(reqs, members)
        return dataclasses.replace(b, rows=b.rows + 1)

    monkeypatch.setattr(scoring, "_batch", late)
    wrong = SCORE[family, "torch"](config, weights, requests)
    with pytest.raises(AssertionError, match="logprob off by"):
        check_against_hf(model, requests, wrong, "late")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(requests=[TraceRequest("u", (1, 2), None, 3)]), ValueError, r"requests\[0\] \('u'\) has no trace"),
        (dict(requests=[TraceRequest("v", (1,), (9999,))]), ValueError, r"holds token 9999, outside \[0, "),
        (dict(requests=[TraceRequest("w", (1,) * 100, (2,) * 100)]), ValueError, r"holds 200 tokens, more than"),
        (dict(requests="abc"), TypeError, r"requests must be a sequence of TraceRequest \(got str\)"),
        (dict(max_tokens=0), ValueError, r"max_tokens must be at least 1 \(got 0\)"),
        (dict(chunk_rows=True), TypeError, r"chunk_rows must be an int \(got bool True\)"),
        (dict(dtype="float16"), ValueError, r"dtype must be one of float32, bfloat16 \(got 'float16'\)"),
        (dict(device="tpu"), ValueError, r"^device must be 'cpu', 'cuda' or 'cuda:N' \(got 'tpu'\)$"),
        (
            dict(top_k=-1),
            ValueError,
            r"top_k must be between 0 and \d+ \(the op's limit and the vocabulary\) \(got -1\)",
        ),
        (dict(top_k=10**6), ValueError, r"top_k must be between 0 and \d+ .*\(got 1000000\)"),
        (dict(top_k=2.0), TypeError, r"top_k must be an int \(got float 2.0\)"),
    ],
)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_calls_are_refused(models, framework, change, error, match):
    family, config, weights, _ = models["qwen2"]
    call = dict(requests=[TraceRequest("ok", (1, 2), (3, 4))])
    call.update(change)
    with pytest.raises(error, match=match):
        SCORE[family, framework](config, weights, **call)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_processed_logprobs_are_those_of_logits_over_t(models, framework, rng):
    """``logprobs_mode="processed_logprobs"``: score's logprobs are log_softmax(logits / T) of
    transformers' logits, and decode with replay at the same sampling temperature agrees."""
    family, config, weights, model = models["qwen2"]
    requests = make_completions(rng, config.vocab_size, n=4)
    t = 1.7
    got = SCORE[family, framework](config, weights, requests, logprobs_mode="processed_logprobs", temperature=t)
    for r, res in zip(requests, got, strict=True):
        y = reference_logits(model, r.prompt, list(r.trace)) / t
        y = y - y.max(axis=1, keepdims=True)
        want = y[np.arange(len(r.trace)), list(r.trace)] - np.log(np.exp(y).sum(axis=1))
        np.testing.assert_allclose(res.logprobs, want, rtol=0, atol=1e-5, err_msg=r.id)
    raw = SCORE[family, framework](config, weights, requests)
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(got, raw)) > 1e-2
    decoded = DECODE[family, framework](
        config, weights, requests, max_batch=2, temperature=t, seed=3, logprobs_mode="processed_logprobs"
    )
    for a, b in zip(got, decoded, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5, err_msg=a.id)
    with pytest.raises(
        ValueError, match=r"temperature must be above 0 for logprobs_mode='processed_logprobs' \(got 0.0\)"
    ):
        SCORE[family, framework](config, weights, requests, logprobs_mode="processed_logprobs", temperature=0.0)
    with pytest.raises(
        ValueError, match=r"logprobs_mode must be one of raw_logprobs, processed_logprobs \(got 'raw'\)"
    ):
        DECODE[family, framework](config, weights, requests, logprobs_mode="raw")
