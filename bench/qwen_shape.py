"""The model and workload that ``models.py`` and ``multi_gpu.py`` share: a Qwen2.5-0.5B-shaped
random model (its tiny twin for ``--quick``), and traced requests of random lengths."""

from __future__ import annotations

from typing import Any

import numpy as np

# Qwen2.5-0.5B's shape, and a tiny one for --quick runs on a CPU.
FULL: dict[str, Any] = dict(
    sizes=dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    ),
    batches=(64, 256),
    prompt=(64, 512),
    trace=(128, 512),
)
QUICK: dict[str, Any] = dict(
    sizes=dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    batches=(4, 8),
    prompt=(8, 24),
    trace=(8, 24),
)


def hf_model(sizes: dict[str, int], device: str):
    """transformers' qwen2 model of ``sizes``, bf16, random weights seeded with 0, built on
    ``device`` (``"cpu"`` or ``"cuda"``), in eval mode; returns ``(model, hf_config)``."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(
        "qwen2",
        **sizes,
        tie_word_embeddings=True,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    return model, hf_config


def traced_requests(rng: np.random.Generator, batch: int, prompt: tuple, trace: tuple, vocab: int) -> list:
    """``batch`` traced requests, prompt and trace lengths drawn from the inclusive ranges."""
    from trace_replay_app.records import TraceRequest

    out = []
    for i in range(batch):
        p = rng.integers(0, vocab, int(rng.integers(prompt[0], prompt[1] + 1)))
        t = rng.integers(0, vocab, int(rng.integers(trace[0], trace[1] + 1)))
        out.append(TraceRequest(f"r{i}", prompt=tuple(int(x) for x in p), trace=tuple(int(x) for x in t)))
    return out


def prefill_only(requests: list) -> list:
    """The same requests with one-token traces: what a run costs before its decode steps."""
    return [type(r)(r.id, prompt=r.prompt, trace=r.trace[:1]) for r in requests]
