"""Tiny Llama-family checkpoints made by transformers itself, and its numerics as the reference.

Shared by ``test_llama_loops.py`` (CPU) and ``test_gpu_models.py`` (CUDA). Import only after
``pytest.importorskip("transformers")``. Nothing is downloaded: every model comes from
``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config`` with random weights.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np
import torch
import transformers

from trace_replay_app.checkpoint import load_checkpoint
from trace_replay_app.records import TraceRequest

_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# id -> (model_type, config options, save options). Between them: tied and untied embeddings,
# rope_scaling llama3 and default, biases (attention, MLP, q/k/v), a sliding window shorter
# than the sequences, per-head q/k norms with an explicit head_dim, a sharded save, a bf16 save.
CASES: Dict[str, tuple] = {
    "llama-tied-llama3-sharded": ("llama", dict(tie_word_embeddings=True, rope_parameters=_LLAMA3),
                                  dict(max_shard_size="100KB")),
    "llama-untied-llama3-biases": ("llama", dict(tie_word_embeddings=False, rope_parameters=_LLAMA3,
                                                 attention_bias=True, mlp_bias=True), {}),
    "mistral-window-bf16": ("mistral", dict(tie_word_embeddings=False, sliding_window=6), dict(dtype="bfloat16")),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
              {}),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=32), {}),
}


def make_checkpoint(case: str, folder: str, seed: int = 0) -> str:
    """Save the tiny model of ``case`` (random weights from ``seed``) under ``folder``; return it."""
    model_type, options, save = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **_SIZES, **options)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
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
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def make_requests(rng: np.random.Generator, vocab: int, n: int = 6, longest: int = 24) -> List[TraceRequest]:
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
            out.append(TraceRequest(f"t{i}", prompt=prompt, trace=tuple(int(t) for t in rng.integers(0, vocab, length))))
        else:
            out.append(TraceRequest(f"u{i}", prompt=prompt, max_new_tokens=length))
    return out


def teacher_forced(model, prompt: Sequence[int], tokens: Sequence[int]):
    """``(logprobs, ranks, argmax)`` of ``tokens`` continuing ``prompt`` under transformers' own
    forward over ``prompt + tokens[:-1]`` (logprobs in float64 from its logits, float32 on the
    host; rank = entries whose logit is >= the token's own)."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:].float().cpu().numpy().astype(np.float64)
    tok = np.asarray(tokens)
    own = logits[np.arange(tok.size), tok]
    top = logits.max(axis=1, keepdims=True)
    logprobs = own - (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    ranks = (logits >= own[:, None]).sum(axis=1)
    return logprobs, ranks, logits.argmax(axis=1)


def greedy(model, prompt: Sequence[int], n: int) -> List[int]:
    """transformers' ``generate(do_sample=False)`` of ``n`` tokens after ``prompt``."""
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_against_hf(model, requests, results, what: str, *, atol: float = 1e-5, exact_ranks: bool = True) -> None:
    """Every result against transformers: traced tokens are the trace; untraced ones are its
    greedy ``generate``; every logprob within ``atol`` and every rank equal (or within 1 when
    not ``exact_ranks``)."""
    for r, res in zip(requests, results):
        who = f"{what}, request {r.id}"
        assert res.id == r.id
        if r.trace is not None:
            assert res.tokens.tolist() == list(r.trace), who
            assert res.forced.all(), who
        else:
            want = greedy(model, r.prompt, r.max_new_tokens)
            assert res.tokens.tolist() == want, f"{who}: greedy tokens {res.tokens.tolist()} != generate {want}"
            assert not res.forced.any(), who
        logprobs, ranks, argmax = teacher_forced(model, r.prompt, res.tokens.tolist())
        diff = np.abs(res.logprobs - logprobs)
        bad = np.nonzero(diff > atol)[0]
        assert bad.size == 0, f"{who}: logprob off by {diff.max():.3g} at positions {bad[:8].tolist()}"
        if exact_ranks:
            assert res.ranks.tolist() == ranks.tolist(), f"{who}: ranks {res.ranks.tolist()} != {ranks.tolist()}"
            assert res.argmax.tolist() == argmax.tolist(), who
        else:
            assert np.abs(res.ranks - ranks).max() <= 1, f"{who}: ranks {res.ranks.tolist()} vs {ranks.tolist()}"


def check_same(a, b, what: str, atol: float = 1e-5) -> None:
    """Two runs' results agree: tokens and ranks equal, logprobs within ``atol``."""
    for x, y in zip(a, b, strict=True):
        assert x.id == y.id
        assert x.tokens.tolist() == y.tokens.tolist(), f"{what}, request {x.id}: tokens differ"
        assert x.ranks.tolist() == y.ranks.tolist(), f"{what}, request {x.id}: ranks differ"
        assert np.abs(x.logprobs - y.logprobs).max(initial=0) <= atol, f"{what}, request {x.id}: logprobs differ"
