"""Tiny GPT-2 checkpoints written by transformers itself (``GPT2Config`` + ``GPT2LMHeadModel`` +
``save_pretrained(safe_serialization=True)``), read through the application's checkpoint reader.

Shared by ``test_gpt2_transformers.py`` (CPU) and ``test_gpu_gpt2_loops.py`` (CUDA). Nothing is
downloaded. transformers
initialises biases to 0 and LayerNorm gains to 1; every one of them is drawn at random here
instead, so that a loop that drops a bias or a gain cannot match by accident.
"""

from __future__ import annotations

import os

import torch
import transformers

from trace_replay_app.checkpoint import load_checkpoint

# id -> GPT2Config options: a square model, and one with odd sizes (a prime vocabulary, 3 heads
# of 16, a layer norm epsilon far from the default).
CASES: dict[str, dict] = {
    "gpt2-small": dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    "gpt2-odd": dict(vocab_size=251, n_positions=48, n_embd=48, n_layer=3, n_head=3, layer_norm_epsilon=1e-3),
}


def make_checkpoint(case: str, folder: str, seed: int = 0) -> str:
    """Save transformers' GPT-2 of ``case`` (random weights from ``seed``, biases and gains
    drawn too) under ``folder`` as safetensors; return the folder."""
    config = transformers.GPT2Config(
        **CASES[case], initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def load(folder: str):
    """``(config, weights)`` of a checkpoint folder, through the application's reader."""
    _, config, weights = load_checkpoint(folder)
    return config, weights
