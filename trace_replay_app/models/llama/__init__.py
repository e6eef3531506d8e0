"""The Llama-family models: ``llama`` (Llama 2/3/3.1, also serving ``mistral`` checkpoints),
``qwen2``, ``qwen3``, ``phi3`` (Phi-3, Phi-4), ``olmo2``, ``olmo3``, ``smollm3``, ``gemma2`` and ``gemma3``,
one framework-neutral config (``config.py``, numpy only; the Hugging Face ``config.json`` and
tensor conversions in ``hf.py``) and the prefill/decode math in each framework with its
``run_decode`` on that framework's shared driver (``torch_loop.py`` with ``torch_layers.py``,
``jax_loop.py``; :mod:`trace_replay_app.drivers`), imported only by :func:`load_loop`. Tensor
parallelism (``tensor_parallel=``) and a JAX mesh (``mesh=``) are options of those
``run_decode``.

The registry entries share the config class and the loops; they differ in the Hugging
Face ``model_type`` values they serve and in the small default config of a seeded run.
"""

from __future__ import annotations

import functools

from ..family import Family, loop_loader
from .config import (
    MODEL_TYPES,
    LlamaConfig,
    check_weights,
    default_config,
    describe,
    param_shapes,
    seeded_weights,
)
from .hf import config_from_hf, to_hf, weights_from_tensors

__all__ = [
    "FAMILIES",
    "LlamaConfig",
    "MODEL_TYPES",
    "config_from_hf",
    "default_config",
    "param_shapes",
    "seeded_weights",
    "check_weights",
    "weights_from_tensors",
    "to_hf",
    "describe",
    "load_loop",
]


def _loop_module(framework: str):
    if framework == "torch":
        from . import torch_loop as module
    else:
        from . import jax_loop as module  # type: ignore[no-redef]
    return module


load_loop = loop_loader(_loop_module)  # framework -> its run_decode (or entry "run_score"), imported now


def _family(name: str, label: str, model_types) -> Family:
    return Family(
        name=name,
        label=label,
        model_types=tuple(model_types),
        config_type=LlamaConfig,
        config_from_hf=config_from_hf,
        default_config=functools.partial(default_config, model_types[0]),
        seeded_weights=seeded_weights,
        weights_from_tensors=weights_from_tensors,
        check_weights=check_weights,
        load_loop=load_loop,
        to_hf=to_hf,
        describe=describe,
    )


FAMILIES = (
    _family("llama", "Llama-family model", ("llama", "mistral")),
    _family("qwen2", "Qwen2-family model", ("qwen2",)),
    _family("qwen3", "Qwen3-family model", ("qwen3",)),
    _family("phi3", "Phi-3-family model", ("phi3",)),
    _family("olmo2", "OLMo-2-family model", ("olmo2",)),
    _family("olmo3", "OLMo-3-family model", ("olmo3",)),
    _family("smollm3", "SmolLM3-family model", ("smollm3",)),
    _family("gemma2", "Gemma-2-family model", ("gemma2",)),
    _family("gemma3", "Gemma-3-family model", ("gemma3_text",)),
)
