"""The ``gpt2`` family: a GPT-2-style decoder (learned positions, pre-LayerNorm blocks,
``gelu_new``, tied output projection). ``config.py`` is numpy-only (config, weight names and
shapes, seeded weights); ``torch_loop.py`` and ``jax_loop.py`` hold the family's prefill/decode
math in each framework and its ``run_decode`` on that framework's shared driver
(:mod:`trace_replay_app.drivers`), imported only by :func:`load_loop`."""

from __future__ import annotations

from ..family import Family, loop_loader
from .config import (
    GPT2Config,
    check_weights,
    config_from_hf,
    describe,
    param_shapes,
    reference_logits,
    seeded_weights,
    to_hf,
    weights_from_tensors,
)

__all__ = [
    "FAMILY",
    "GPT2Config",
    "param_shapes",
    "seeded_weights",
    "check_weights",
    "reference_logits",
    "config_from_hf",
    "weights_from_tensors",
    "to_hf",
    "load_loop",
]


def _loop_module(framework: str):
    if framework == "torch":
        from . import torch_loop as module
    else:
        from . import jax_loop as module  # type: ignore[no-redef]
    return module


load_loop = loop_loader(_loop_module)  # framework -> its run_decode (or entry "run_score"), imported now


FAMILY = Family(
    name="gpt2",
    label="GPT-2-style model",
    model_types=("gpt2",),
    config_type=GPT2Config,
    config_from_hf=config_from_hf,
    default_config=GPT2Config,
    seeded_weights=seeded_weights,
    weights_from_tensors=weights_from_tensors,
    check_weights=check_weights,
    load_loop=load_loop,
    to_hf=to_hf,
    describe=describe,
)
