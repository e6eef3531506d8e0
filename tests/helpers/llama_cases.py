"""Tiny Llama-family checkpoints made by transformers itself, and its numerics as the reference.

Shared by ``test_llama_loops.py`` (CPU) and ``test_gpu_models.py`` (CUDA). Nothing is downloaded: every model comes from
``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config`` with random weights (biases
drawn too: transformers starts them at 0).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers

from trace_replay_app.checkpoint import load_checkpoint
from trace_replay_app.records import RequestResult, TraceRequest

_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}

# id -> (model_type, config options, save options). Between them: tied and untied embeddings,
# rope_scaling llama3, yarn, linear and default, biases (attention, MLP, q/k/v), sliding windows
# shorter than the sequences, Phi-3's fused projections, OLMo 2's output norms, OLMo 3's rotary
# embeddings per layer type, Gemma 3's sandwich norms and scaled embeddings, per-head q/k norms
# with an explicit head_dim, a sharded save, a bf16 save.
CASES: dict[str, tuple] = {
    "llama-tied-llama3-sharded": (
        "llama",
        dict(tie_word_embeddings=True, rope_parameters=_LLAMA3),
        dict(max_shard_size="100KB"),
    ),
    "llama-untied-llama3-biases": (
        "llama",
        dict(tie_word_embeddings=False, rope_parameters=_LLAMA3, attention_bias=True, mlp_bias=True),
        {},
    ),
    "mistral-window-bf16": ("mistral", dict(tie_word_embeddings=False, sliding_window=6), dict(dtype="bfloat16")),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), {}),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=32), {}),
    "qwen3-yarn": ("qwen3", dict(tie_word_embeddings=False, head_dim=32, rope_parameters=_YARN), {}),
    "phi3-window": ("phi3", dict(tie_word_embeddings=False, sliding_window=6), {}),
    "olmo2-biases": ("olmo2", dict(tie_word_embeddings=False, attention_bias=True), {}),
    "smollm3-nope-window": (  # layer 1 without rotary embeddings, and windowed
        "smollm3",
        dict(
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=5,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        {},
    ),
    "gemma2-softcap": (  # caps small enough to matter on a tiny random model's scores and logits
        "gemma2",
        dict(
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=5,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
        ),
        {},
    ),  # fmt: skip
    "gemma3-window": (
        "gemma3_text",
        dict(
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
        {},
    ),
    "olmo3-yarn-window": (
        "olmo3",
        dict(
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": _YARN,
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
        {},
    ),
    "llama-linear": (
        "llama",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
        {},
    ),
}


# The first five cases (Llama, Mistral, Qwen2, Qwen3) and the model types added to the family
# after them: test_llama_loops.py runs every loop test on the first, test_llama_model_types.py
# checks the others against transformers in both loops (two files, so pytest's workers share them).
CORE_CASES = ("llama-tied-llama3-sharded", "llama-untied-llama3-biases", "mistral-window-bf16", "qwen2", "qwen3")
VARIANT_CASES = tuple(sorted(set(CASES) - set(CORE_CASES)))


def decode_loops() -> dict:
    """framework -> the Llama family's ``run_decode``: torch, and JAX when jax is installed (only a
    missing jax leaves it out: an import error in our own loop fails the caller)."""
    from trace_replay_app.models.llama import torch_loop

    loops = {"torch": torch_loop.run_decode}
    if importlib.util.find_spec("jax") is not None:
        from trace_replay_app.models.llama import jax_loop

        loops["jax"] = jax_loop.run_decode
    return loops


def check_case_against_hf(checkpoints: dict, case: str, run, what: str, rng) -> None:
    """``case``'s checkpoint (from :func:`checkpoints_of`) through the decode loop ``run``
    against transformers' teacher-forced forward (:func:`check_against_hf`)."""
    _, config, weights, model = checkpoints[case]
    assert config.model_type == CASES[case][0]
    requests = make_requests(rng, config.vocab_size)
    check_against_hf(model, requests, run(config, weights, requests, max_batch=3), what)


def check_loops_agree(checkpoints: dict, case: str, loops: dict, rng) -> None:
    """The torch and JAX loops on ``case``'s checkpoint give the same tokens and logprobs
    (:func:`check_same`, ranks against transformers' logits)."""
    _, config, weights, model = checkpoints[case]
    requests = make_requests(rng, config.vocab_size, n=7)
    a = loops["torch"](config, weights, requests, max_batch=3)
    b = loops["jax"](config, weights, requests, max_batch=3)
    check_same(a, b, f"{case} torch vs jax", reference=model, requests=requests)


def checkpoints_of(cases, tmp_path_factory, seed: int = 0) -> dict:
    """case -> (folder, config, weights, transformers' model) of each of ``cases``, made under
    ``tmp_path_factory`` (case ``i`` with seed ``seed + i``)."""
    out = {}
    for i, case in enumerate(cases):
        folder = make_checkpoint(case, str(tmp_path_factory.mktemp(case)), seed=seed + i)
        out[case] = (folder, *load(folder), hf_model(folder))
    return out


def make_checkpoint(case: str, folder: str, seed: int = 0, **overrides: Any) -> str:
    """Save the tiny model of ``case`` (random weights from ``seed``; ``overrides``: config
    options over the case's sizes and options) under ``folder``; return it."""
    model_type, options, save = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **{**_SIZES, **options, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # transformers starts biases at 0 and norm gains at 1 (Gemma's at 0, as it adds 1): a loop
    # that drops one, or swaps two norms, would match by accident
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if save.get("dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, **{k: v for k, v in save.items() if k == "max_shard_size"})
    return folder


def load(folder: str):
    """``(config, weights)`` of a checkpoint folder, through the application's loader."""
    _, config, weights = load_checkpoint(folder)
    return config, weights


def hf_model(folder: str, device: str = "cpu", dtype=torch.float32):
    """transformers' own model of ``folder`` (eager attention) in ``dtype`` on ``device``."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def make_requests(rng: np.random.Generator, vocab: int, n: int = 6, longest: int = 24) -> list[TraceRequest]:
    """``n`` requests, alternately traced (random trace tokens) and untraced (greedy), prompts
    and new tokens of 1 to ``longest // 2 - 1`` tokens each."""
    out = []
    for i in range(n):
        # The first request takes the longest prompt and trace: every run of the same ``n``
        # and ``longest`` then has the same buckets (the JAX loop compiles once per case).
        size = longest // 2 - 1
        prompt = tuple(int(t) for t in rng.integers(0, vocab, size if i == 0 else int(rng.integers(1, size + 1))))
        length = size if i == 0 else int(rng.integers(1, size + 1))
        if i % 2 == 0:
            out.append(
                TraceRequest(f"t{i}", prompt=prompt, trace=tuple(int(t) for t in rng.integers(0, vocab, length)))
            )
        else:
            out.append(TraceRequest(f"u{i}", prompt=prompt, max_new_tokens=length))
    return out


def make_completions(rng, vocab: int, n: int = 5, longest: int = 20) -> list[TraceRequest]:
    """Requests of random prompts (1 to 8 tokens) and completions (1 to ``longest`` tokens)."""
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
        out.append(
            TraceRequest(
                f"r{i}", tuple(prompt), tuple(rng.integers(0, vocab, int(rng.integers(1, longest + 1))).tolist())
            )
        )
    return out


def reference_logits(model, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """transformers' logits (float64 on the host, ``[len(tokens), vocab]``) at each position of
    ``tokens`` continuing ``prompt``: one forward over ``prompt + tokens[:-1]``."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=model.device)
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 :].float().cpu().numpy().astype(np.float64)


def teacher_forced(model, prompt: Sequence[int], tokens: Sequence[int]):
    """``(logprobs, ranks, argmax)`` of ``tokens`` continuing ``prompt`` under transformers' own
    forward over ``prompt + tokens[:-1]`` (logprobs in float64 from its logits, float32 on the
    host; rank = entries whose logit is >= the token's own)."""
    return _stats(reference_logits(model, prompt, tokens), np.asarray(tokens))


def _stats(logits: np.ndarray, tokens: np.ndarray):
    """``(logprobs, ranks, argmax)`` of ``tokens`` under float64 ``logits``."""
    own = logits[np.arange(tokens.size), tokens]
    top = logits.max(axis=1, keepdims=True)
    logprobs = own - (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    ranks = (logits >= own[:, None]).sum(axis=1)
    return logprobs, ranks, logits.argmax(axis=1)


# Logit gap (float32 arithmetic, logits of order 1) below which two implementations may order a
# pair of tokens differently: a tensor-parallel all-reduce, another GEMM shape or another
# framework sums the same products in another order (differences of ~1e-6 seen).
RANK_EPS = 1e-4


def rank_bounds(logits: np.ndarray, tokens: np.ndarray, eps: float = RANK_EPS):
    """Per position, the ranks ``(lo, hi)`` that any computation whose logits each lie within
    ``eps / 2`` of ``logits`` may give ``tokens`` (rank = entries whose logit is >= the
    token's own): ``lo`` counts the token and the entries above it by more than ``eps``, ``hi``
    every entry within ``eps`` below it or higher. Where no other logit lies within ``eps`` of
    the token's, ``lo == hi``: the rank is exact."""
    own = logits[np.arange(tokens.size), tokens][:, None]
    return (logits > own + eps).sum(axis=1) + 1, (logits >= own - eps).sum(axis=1)


def check_ranks(res, logits: np.ndarray, who: str, eps: float = RANK_EPS) -> None:
    """``res.ranks`` and ``res.argmax`` are those of ``logits`` (the reference's, at
    ``res.tokens``) wherever a gap above ``eps`` decides them; inside a near-tie, within it."""
    lo, hi = rank_bounds(logits, res.tokens, eps)
    bad = np.nonzero((res.ranks < lo) | (res.ranks > hi))[0]
    assert bad.size == 0, (
        f"{who}: ranks {res.ranks[bad[:8]].tolist()} at positions {bad[:8].tolist()}, "
        f"reference allows {lo[bad[:8]].tolist()}..{hi[bad[:8]].tolist()}"
    )
    top = logits.max(axis=1)
    picked = logits[np.arange(res.argmax.size), res.argmax]
    bad = np.nonzero(picked < top - eps)[0]
    assert bad.size == 0, (
        f"{who}: argmax {res.argmax[bad[:8]].tolist()} at positions {bad[:8].tolist()} is not "
        f"the reference's {logits.argmax(axis=1)[bad[:8]].tolist()} (nor within {eps} of it)"
    )


def hf_reference(config, weights, folder: str, device: str = "cpu"):
    """transformers' float32 model of a Llama-family ``config`` with ``weights``, saved under
    ``folder`` through the application's writer; refuses a config transformers cannot express
    (its ``config.json`` must read back as the same config)."""
    from trace_replay_app.checkpoint import save_checkpoint
    from trace_replay_app.models.llama.hf import config_from_hf, to_hf

    back = config_from_hf(to_hf(config, weights)[0])
    assert back == config, f"transformers cannot express {config} (it reads back as {back})"
    save_checkpoint(folder, config, weights)
    return hf_model(folder, device=device)


def greedy(model, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` of ``n`` tokens after ``prompt``."""
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def check_against_hf(model, requests, results, what: str, *, atol: float = 1e-5, eps: float = RANK_EPS) -> None:
    """Every result against transformers: traced tokens are the trace; untraced ones are its
    greedy ``generate`` (or part from it only where its logits nearly tie at the top, and are
    compared up to there); every logprob within ``atol``; ranks and argmax as
    :func:`check_ranks` (exact wherever a logit gap above ``eps`` decides them)."""
    for r, res in zip(requests, results, strict=True):
        who = f"{what}, request {r.id}"
        assert res.id == r.id
        if r.trace is not None:
            assert res.tokens.tolist() == list(r.trace), who
            assert res.forced.all(), who
        else:
            want = greedy(model, r.prompt, r.max_new_tokens)
            assert not res.forced.any(), who
            got = res.tokens.tolist()
            if got != want:  # only where transformers' own logits nearly tie at the top
                j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else -1
                assert j >= 0, f"{who}: greedy tokens {got} != generate {want}"
                at = reference_logits(model, r.prompt, got[: j + 1])[j]
                assert abs(at[got[j]] - at[want[j]]) <= eps and min(at[got[j]], at[want[j]]) >= at.max() - eps, (
                    f"{who}: greedy tokens {got} part from generate {want} at position {j} without a near-tie"
                )
                res = _head(res, j)
                if not j:
                    continue
        logits = reference_logits(model, r.prompt, res.tokens.tolist())
        logprobs, _, _ = _stats(logits, res.tokens)
        diff = np.abs(res.logprobs - logprobs)
        bad = np.flatnonzero(~(diff <= atol))  # NaN is a failure
        assert bad.size == 0, f"{who}: logprob off by {diff.max():.3g} at positions {bad[:8].tolist()}"
        check_ranks(res, logits, who, eps)


def _head(res, n: int):
    """The first ``n`` positions of a result."""
    return RequestResult(res.id, res.tokens[:n], res.forced[:n], res.logprobs[:n], res.ranks[:n], res.argmax[:n])


def check_same(a, b, what: str, atol: float = 1e-5, *, reference=None, requests=None, eps: float = RANK_EPS) -> None:
    """Two runs' results agree: tokens and ``forced`` equal, logprobs within ``atol``.

    ``atol == 0`` claims the same arithmetic: ranks and argmax must be equal too. Otherwise the
    runs sum in different orders, so two logits closer than ``eps`` may swap: pass
    ``reference`` (transformers' model) and the ``requests`` (for their prompts). Both runs'
    ranks and argmax are then checked with :func:`check_ranks` against its logits, and an
    untraced (free-running) request may part where the reference has a near-tie at the top;
    it is compared up to there.
    """
    if atol and (reference is None or requests is None):
        raise TypeError("check_same with atol > 0 compares two arithmetics: pass reference= and requests=")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        who = f"{what}, request {x.id}"
        assert x.id == y.id and (requests is None or requests[i].id == x.id), f"{what}: results out of order"
        n = x.tokens.size
        differ = np.nonzero(x.tokens != y.tokens)[0] if y.tokens.size == n else np.array([min(n, y.tokens.size)])
        if differ.size:
            j = int(differ[0])
            assert atol and requests[i].trace is None and j < min(n, y.tokens.size), (
                f"{who}: tokens differ at positions {differ[:8].tolist()}: {x.tokens.tolist()} vs {y.tokens.tolist()}"
            )
            logits = reference_logits(reference, requests[i].prompt, x.tokens[: j + 1].tolist())[j]
            first, second = logits[x.tokens[j]], logits[y.tokens[j]]
            assert abs(first - second) <= eps and min(first, second) >= logits.max() - eps, (
                f"{who}: tokens part at position {j} ({x.tokens[j]} vs {y.tokens[j]}) without a near-tie at the "
                f"top of the reference (logit gap {abs(first - second):.3g})"
            )
            x, y, n = _head(x, j), _head(y, j), j
        assert x.forced.tolist() == y.forced.tolist(), f"{who}: forced differs"
        diff = np.abs(x.logprobs - y.logprobs)
        assert diff.max(initial=0) <= atol, f"{who}: logprobs differ by {diff.max():.3g}"
        if not atol:
            bad = np.nonzero((x.ranks != y.ranks) | (x.argmax != y.argmax))[0]
            assert bad.size == 0, (
                f"{who}: ranks/argmax differ at positions {bad[:8].tolist()}: "
                f"{x.ranks[bad[:8]].tolist()}/{x.argmax[bad[:8]].tolist()} vs "
                f"{y.ranks[bad[:8]].tolist()}/{y.argmax[bad[:8]].tolist()}"
            )
        elif n:
            logits = reference_logits(reference, requests[i].prompt, x.tokens.tolist())
            check_ranks(x, logits, f"{who} (first)", eps)
            check_ranks(y, logits, f"{who} (second)", eps)


def check_top_k_against_hf(model, requests, results, k: int, what: str) -> None:
    """Each scored position's ``k`` most likely ids are those of transformers' logits wherever
    gaps above ``RANK_EPS`` on both sides decide them, in order, and their logprobs are within
    1e-5 of transformers' (float64 ``log_softmax`` of its float32 logits)."""
    for r, res in zip(requests, results, strict=True):
        assert res.topk_ids is not None and res.topk_logprobs is not None, what
        assert res.topk_ids.shape == res.topk_logprobs.shape == (len(r.trace), k), what
        assert res.topk_ids.dtype == np.int64 and res.topk_logprobs.dtype == np.float32, what
        y = reference_logits(model, r.prompt, list(r.trace)).astype(np.float64)
        lsm = y - y.max(axis=1, keepdims=True)
        lsm -= np.log(np.exp(lsm).sum(axis=1, keepdims=True))
        order = np.argsort(-lsm, axis=1, kind="stable")[:, : k + 1]
        want = np.take_along_axis(lsm, order, axis=1)
        np.testing.assert_allclose(res.topk_logprobs, want[:, :k], rtol=0, atol=1e-5, err_msg=f"{what} {r.id}")
        decided = want[:, :k] - want[:, 1:] > RANK_EPS  # the gap between places i and i + 1
        for pos in range(len(r.trace)):
            for i in range(k):
                if (i == 0 or decided[pos, i - 1]) and decided[pos, i]:
                    assert res.topk_ids[pos, i] == order[pos, i], (what, r.id, pos, i)
