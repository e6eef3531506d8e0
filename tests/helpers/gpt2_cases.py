"""Checks of the GPT-2-style decode loops (``trace_replay_app.models.gpt2``) against a float64
numpy forward of the model, against each other, and across batch sizes, shared by
``test_gpt2_loops.py`` (CPU), ``test_gpu_gpt2_loops.py`` (CUDA) and ``test_sampling.py``.

How results are compared. The loops compute in float32, the reference (``reference_logits``,
a full-sequence recompute without a cache) in float64, teacher-forced on the tokens the loop
produced, so a loop is checked at every position it decoded:

- logprobs within ``LOGPROB_ATOL``: float32 rounding (2^-24 relative) over two layers, three
  LayerNorms and a 512-way log-sum-exp gives at most ~7e-7 with the seeded weights (logits
  ~0.2) and ~5e-6 with the scaled ones (logits ~2), measured on this CPU for both loops; the
  tolerance leaves a margin of 10x over the worst, and is still far below what a modelling
  error does (a missing bias moves logprobs by 4e-3 to 0.1, an off-by-one position by 0.6).
- the greedy ``argmax`` must be the reference's argmax, or within ``TIE_ATOL`` of its logit
  (a near-tie that float32 may legitimately break either way); ranks must lie within the
  reference's rank band ``[#(logit >= own + TIE_ATOL), #(logit >= own - TIE_ATOL)]``.
- two runs (two batch sizes, two frameworks) must give identical tokens; a free-running
  request may part only at a genuine near-tie of the reference, and is compared up to there.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import trace_replay_app.models.gpt2.jax_loop as jax_gpt2  # noqa: E402
import trace_replay_app.models.gpt2.torch_loop as torch_gpt2  # noqa: E402
from trace_replay_app.models.gpt2 import GPT2Config, reference_logits, seeded_weights  # noqa: E402
from trace_replay_app.records import RequestResult, TraceRequest  # noqa: E402
from trace_replay_app.schedule import plan  # noqa: E402

LOOPS = {"torch": torch_gpt2.run_decode, "jax": jax_gpt2.run_decode}


CONFIG = GPT2Config()  # vocab 512, 128 positions, 64 wide, 2 layers, 4 heads


LOGPROB_ATOL = 5e-5  # see the module docstring


TIE_ATOL = 1e-4  # logits closer than this are a tie that float32 may break either way


@pytest.fixture(autouse=True)
def torch_one_thread():
    """One intra-op thread for torch while these tests run (restored after). The model's tensors
    are tiny: extra threads only synchronise, and on a busy two-core machine they made the same
    torch run 4-60x slower (0.1 s with one thread, 0.4-6 s with two, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def small_jax_chunks(monkeypatch):
    """JAX keeps per-step outputs on the device in chunks of steps: small chunks here, so that
    every run crosses chunk boundaries (and all tests share one chunk shape: fewer compilations)."""
    from trace_replay_app.drivers import jax_chunks

    monkeypatch.setattr(jax_chunks, "CHUNK", 16)  # the driver's chunking and the buffers it allocates


# -- data ---------------------------------------------------------------------------------------
def weights_for(rng, kind: str = "seeded"):
    """``seeded``: the model's seeded weights (logits ~0.2, flat distributions); ``scaled``: the
    same with embeddings x4 and the attention/MLP input projections x3 (logits ~2, larger
    activations, peaked distributions)."""
    w = seeded_weights(CONFIG, seed=int(rng.integers(2**31)))
    if kind == "scaled":
        w["wte.weight"] = w["wte.weight"] * 4
        for layer in range(CONFIG.n_layer):
            for name in ("attn.c_attn.weight", "mlp.c_fc.weight"):
                w[f"h.{layer}.{name}"] = w[f"h.{layer}.{name}"] * 3
    return w


def make_requests(rng, n: int, *, traced_share: float = 0.5, prefix: str = "r"):
    """``n`` requests with prompts of 1-12 tokens and 1-14 new tokens; traced ones replay random
    tokens (mostly not what the model would choose). The first prompt has one token (no prefill).
    One extra request of 12 + 12 tokens keeps every test's KV length in one JAX bucket (32)."""
    requests = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, 1 if i == 0 else int(rng.integers(1, 13))))
        new = int(rng.integers(1, 15))
        if rng.random() < traced_share:
            trace = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, new))
            requests.append(TraceRequest(f"{prefix}{i}", prompt, trace))
        else:
            requests.append(TraceRequest(f"{prefix}{i}", prompt, max_new_tokens=new))
    long = TraceRequest(
        f"{prefix}-long", tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, 12)), max_new_tokens=12
    )
    requests.insert(int(rng.integers(0, n + 1)), long)
    return requests


# -- checks (shared with the GPU tier) ----------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))


def reference_rows(weights, request: TraceRequest, tokens: np.ndarray) -> np.ndarray:
    """float64 logits ``[len(tokens), vocab]``: row ``j`` scores output ``j`` given the prompt and
    ``tokens[:j]`` (the loop's own outputs, teacher-forced)."""
    sequence = list(request.prompt) + [int(t) for t in tokens]
    return reference_logits(CONFIG, weights, sequence[:-1])[len(request.prompt) - 1 :]


def check_against_reference(weights, requests, results, what: str) -> None:
    """Every result against the float64 reference; see the module docstring for the rules."""
    assert [r.id for r in results] == [r.id for r in requests], f"{what}: results not in request order"
    for req, res in zip(requests, results):
        who = f"{what}, request {req.id}"
        assert isinstance(res, RequestResult)
        n = req.new_tokens
        for name, dtype in (
            ("tokens", np.int64),
            ("forced", np.bool_),
            ("logprobs", np.float32),
            ("ranks", np.int64),
            ("argmax", np.int64),
        ):
            arr = getattr(res, name)
            assert arr.shape == (n,) and arr.dtype == dtype, f"{who}: {name} is {arr.dtype}{arr.shape}"
        if req.trace is not None:
            np.testing.assert_array_equal(res.tokens, req.trace, err_msg=f"{who}: trace not replayed")
            assert res.forced.all(), f"{who}: forced must be True inside the trace"
        else:
            np.testing.assert_array_equal(res.tokens, res.argmax, err_msg=f"{who}: untraced request not greedy")
            assert not res.forced.any(), f"{who}: nothing is forced without a trace"
        ref = reference_rows(weights, req, res.tokens)
        at = np.arange(n)
        ref_lp = log_softmax(ref)[at, res.tokens]
        bad = np.flatnonzero(~(np.abs(res.logprobs - ref_lp) <= LOGPROB_ATOL))  # NaN is a failure
        assert bad.size == 0, (
            f"{who}: logprobs differ from the reference at positions {bad[:10].tolist()}: "
            f"got {res.logprobs[bad[:10]].tolist()} expected {ref_lp[bad[:10]].tolist()}"
        )
        best = ref.max(axis=1)
        bad = np.nonzero(ref[at, res.argmax] < best - TIE_ATOL)[0]
        assert bad.size == 0, (
            f"{who}: argmax is not the reference's at positions {bad[:10].tolist()}: "
            f"got {res.argmax[bad[:10]].tolist()} expected {ref.argmax(axis=1)[bad[:10]].tolist()}"
        )
        own = ref[at, res.tokens][:, None]
        lo, hi = (ref >= own + TIE_ATOL).sum(axis=1), (ref >= own - TIE_ATOL).sum(axis=1)
        bad = np.nonzero((res.ranks < lo) | (res.ranks > hi))[0]
        assert bad.size == 0, (
            f"{who}: ranks outside the reference band at positions {bad[:10].tolist()}: "
            f"got {res.ranks[bad[:10]].tolist()}, band {lo[bad[:10]].tolist()}-"
            f"{hi[bad[:10]].tolist()}"
        )


def check_same_results(weights, requests, a, b, what: str) -> None:
    """Two runs of the same requests: identical tokens (a free-running request may part only at a
    near-tie of the reference, and is compared up to there) and close logprobs; each run is
    also checked against the reference (which bounds the ranks of both)."""
    for req, x, y in zip(requests, a, b):
        who = f"{what}, request {req.id}"
        assert x.id == y.id == req.id
        n = len(x.tokens)
        differ = np.nonzero(x.tokens != y.tokens)[0]
        if differ.size:
            j = int(differ[0])
            assert req.trace is None, f"{who}: traced tokens differ at {differ[:10].tolist()}"
            ref = reference_rows(weights, req, x.tokens[: j + 1])[j]
            gap = abs(ref[x.tokens[j]] - ref[y.tokens[j]])
            assert gap <= TIE_ATOL and ref[x.tokens[j]] >= ref.max() - TIE_ATOL, (
                f"{who}: tokens part at position {j} ({x.tokens[j]} vs {y.tokens[j]}) without a near-tie "
                f"(reference logit gap {gap:.3g})"
            )
            n = j
        np.testing.assert_array_equal(x.forced, y.forced, err_msg=who)
        np.testing.assert_allclose(x.logprobs[:n], y.logprobs[:n], rtol=0, atol=LOGPROB_ATOL, err_msg=who)
    check_against_reference(weights, requests, a, what + " (first)")
    check_against_reference(weights, requests, b, what + " (second)")


def check_matches_reference(run, device, rng, kind: str) -> None:
    weights = weights_for(rng, kind)
    requests = make_requests(rng, 10)
    results = run(CONFIG, weights, requests, device=device, max_batch=3)
    check_against_reference(weights, requests, results, f"{kind} weights")
    traced_ranks = np.concatenate([r.ranks for q, r in zip(requests, results) if q.trace is not None])
    if kind == "seeded":  # random tokens under a flat distribution: most rank far from the top
        assert (traced_ranks > 1).mean() > 0.5, traced_ranks


def check_untraced_unaffected(run, device, rng) -> None:
    """Free requests decode the same tokens alone and with traced neighbours in the batch."""
    weights = weights_for(rng)
    free = make_requests(rng, 6, traced_share=0.0, prefix="free")
    traced = [r for r in make_requests(rng, 6, traced_share=1.0, prefix="traced") if r.trace is not None]
    mixed = [r for pair in zip(traced, free) for r in pair] + free[len(traced) :]
    alone = run(CONFIG, weights, free, device=device, max_batch=3)
    together = run(CONFIG, weights, mixed, device=device, max_batch=3)
    by_id = {r.id: r for r in together}
    check_same_results(weights, free, alone, [by_id[r.id] for r in free], "alone vs with traced neighbours")
    check_against_reference(weights, mixed, together, "with traced neighbours")


def check_batch_sizes(run, device, rng) -> None:
    """More requests than slots: results agree across max_batch 1, 3 and 8; on_step reports every step."""
    weights = weights_for(rng)
    requests = make_requests(rng, 11)
    total = sum(r.new_tokens for r in requests)
    results = {}
    for max_batch in (1, 3, 8):
        schedule = plan([r.new_tokens for r in requests], max_batch)
        assert np.bincount(schedule.slot[schedule.slot >= 0]).max() > 1, "no slot was reused"
        steps: list[int] = []
        results[max_batch] = run(CONFIG, weights, requests, device=device, max_batch=max_batch, on_step=steps.append)
        assert len(steps) == schedule.n_steps and sum(steps) == total, (max_batch, steps)
        assert steps == schedule.tokens_per_step.tolist()
    check_same_results(weights, requests, results[3], results[1], "max_batch 3 vs 1")
    check_same_results(weights, requests, results[3], results[8], "max_batch 3 vs 8")


def check_torch_vs_jax(device, rng) -> None:
    weights = weights_for(rng)
    requests = make_requests(rng, 10)
    a = torch_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3)
    b = jax_gpt2.run_decode(CONFIG, weights, requests, device=device, max_batch=3)
    check_same_results(weights, requests, a, b, "torch vs jax")


def _docstring_example(module) -> str:
    """The indented block after the first ``::`` of a module docstring."""
    block = []
    for line in module.__doc__.split("::\n", 1)[1].splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))
