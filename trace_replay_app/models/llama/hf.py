"""The Llama family and Hugging Face checkpoints: ``config.json`` -> :class:`~.config.LlamaConfig`,
a checkpoint's tensors -> the loops' weights, and back (numpy only; host-only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..hf_fields import get_bool, get_float, get_int
from .config import MODEL_TYPES, LlamaConfig, check_weights, param_shapes
from .hf_rope import layered_rope_options, rope_options, rope_parameters

__all__ = ["config_from_hf", "weights_from_tensors", "to_hf"]

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_ATTENTION_BIAS = ("llama", "qwen3", "olmo2", "olmo3", "smollm3", "gemma2", "gemma3_text")  # q/k/v and output
_GEMMA = ("gemma2", "gemma3_text")
# What transformers' config class of a model type assumes for a key config.json leaves out,
# where it differs from the Llama defaults (1e-6, hidden_size // heads, 10,000, no window, as
# many key/value heads as query heads).
_ABSENT: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32},
    "smollm3": {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 2000000.0},
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32},
    "phi3": {"rms_norm_eps": 1e-5},
    "olmo2": {"rms_norm_eps": 1e-5},
    "olmo3": {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "sliding_window": 4096},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "num_key_value_heads": 4, "tie_word_embeddings": True}
    | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 256, "sliding_window": 4096, "num_key_value_heads": 4, "tie_word_embeddings": True},
}
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)  # a buffer older checkpoints store


def _absent(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value transformers assumes for ``key`` when ``hf`` (a model type's config.json) lacks it."""
    return _ABSENT.get(hf.get("model_type", ""), {}).get(key, default)


def _number(value: float) -> int | float:
    """``value`` as JSON writes it for transformers' typed configs: an int when it is one."""
    return int(value) if float(value).is_integer() else value


def _windows(hf: Mapping[str, Any], model_type: str, layers: int, nope: tuple[int, ...]) -> tuple[int, ...]:
    """Per-layer sliding windows as transformers applies them: Mistral and Phi-3 slide in every
    layer when ``sliding_window`` is set; Qwen2/Qwen3 only with ``use_sliding_window``, in the
    layers that ``layer_types`` marks ``sliding_attention`` (by default those from
    ``max_window_layers``); OLMo 3 and Gemma 2 and 3 in those layers always (by default three
    of every four, every other one, or five of every ``sliding_window_pattern`` = 6; a window of
    4,096 unless ``sliding_window`` says otherwise)."""
    always = model_type in ("olmo3", "gemma2", "gemma3_text")  # windows per layer_types, no switch
    window = hf.get("sliding_window", _absent(hf, "sliding_window", None))
    if model_type in ("llama", "olmo2") or window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive int or null (got {window!r})")
    if model_type in ("mistral", "phi3"):
        return (window,) * layers
    if not always and not get_bool(hf, "use_sliding_window"):
        return ()
    types = hf.get("layer_types")
    if types is None and always:  # OLMo 3: three sliding layers, then a full one; Gemma 2: one; 3: five
        every = {"olmo3": 4, "gemma2": 2}.get(model_type) or get_int(hf, "sliding_window_pattern", 6)
        if every <= 0:
            raise ValueError(f"sliding_window_pattern must be a positive int (got {every})")
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    elif types is None and model_type == "smollm3":  # windows on the layers without rotary embeddings
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(layers)]
    elif types is None:
        start = get_int(hf, "max_window_layers", layers)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if (
        not isinstance(types, list)
        or len(types) != layers
        or not all(t in ("sliding_attention", "full_attention") for t in types)
    ):
        raise ValueError(
            f"layer_types must list 'full_attention'/'sliding_attention' for each of the {layers} "
            f"layers (got {types!r})"
        )
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _nope_layers(hf: Mapping[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary embeddings: ``no_rope_layers`` (1: rotary embeddings, 0:
    none, one per layer), else every ``no_rope_layer_interval``-th (default 4)."""
    if model_type != "smollm3":
        return ()
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = get_int(hf, "no_rope_layer_interval", 4)
        if every <= 0:
            raise ValueError(f"no_rope_layer_interval must be a positive int (got {every})")
        return tuple(i for i in range(layers) if (i + 1) % every == 0)
    if (
        not isinstance(flags, list)
        or len(flags) != layers
        or any(f not in (0, 1) or isinstance(f, bool) for f in flags)
    ):
        raise ValueError(f"no_rope_layers must list 0 or 1 for each of the {layers} layers (got {flags!r})")
    return tuple(i for i, f in enumerate(flags) if f == 0)


def config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """The config of a Hugging Face ``config.json`` mapping of a model type in
    :data:`~.config.MODEL_TYPES`; ``ValueError`` naming the key for a missing size or an option
    the loops do not implement (another activation, another rotary scaling, partial rotary).
    Keys the loops do not need are ignored."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the llama family (supported: {', '.join(MODEL_TYPES)})"
        )
    gemma = model_type in _GEMMA
    caps: dict[str, Any] = {}
    if gemma:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r} is not supported (Gemma's is 'gelu_pytorch_tanh')")
        if hf.get("use_bidirectional_attention"):  # Gemma's embedding variants: not a decoder
            raise ValueError(f"use_bidirectional_attention={hf['use_bidirectional_attention']!r} is not supported")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # null: none
            caps[key] = get_float(hf, key, 0.0 if key in hf else _absent(hf, key, 0.0))
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (the loops implement SwiGLU with 'silu')")
    heads = get_int(hf, "num_attention_heads", required=True)
    layers = get_int(hf, "num_hidden_layers", required=True)
    attention_bias = get_bool(hf, "attention_bias")
    olmo = model_type in ("olmo2", "olmo3")
    theta = _absent(hf, "rope_theta", 1e4)  # when config.json gives none
    placement = "post" if olmo else ("both" if gemma else "pre")
    nope = _nope_layers(hf, model_type, layers)
    return LlamaConfig(
        model_type=model_type,
        vocab_size=get_int(hf, "vocab_size", required=True),
        hidden_size=get_int(hf, "hidden_size", required=True),
        intermediate_size=get_int(hf, "intermediate_size", required=True),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get_int(hf, "num_key_value_heads", _absent(hf, "num_key_value_heads", heads)),
        head_dim=get_int(hf, "head_dim", _absent(hf, "head_dim", 0)),
        max_position_embeddings=get_int(hf, "max_position_embeddings", required=True),
        rms_norm_eps=get_float(hf, "rms_norm_eps", _absent(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=get_bool(hf, "tie_word_embeddings")
        if hf.get("tie_word_embeddings") is not None
        else _absent(hf, "tie_word_embeddings", False),
        nope_layers=nope,
        qkv_bias=True if model_type == "qwen2" else attention_bias and model_type in _ATTENTION_BIAS,
        o_bias=attention_bias and model_type in _ATTENTION_BIAS,
        mlp_bias=get_bool(hf, "mlp_bias") and model_type == "llama",
        qk_norm=model_type in ("qwen3", "olmo2", "olmo3", "gemma3_text"),  # not gemma2
        norm_placement=placement,
        norm_style="olmo" if olmo else ("gemma" if gemma else "llama"),
        hidden_act=act,
        embed_scale=gemma,
        query_pre_attn_scalar=get_float(hf, "query_pre_attn_scalar", 256.0) if gemma else 0.0,
        layer_windows=_windows(hf, model_type, layers, nope),
        **caps,
        **(
            layered_rope_options(hf, gemma, theta)
            if model_type in ("olmo3", "gemma3_text")
            else rope_options(hf, theta)
        ),
    )


def weights_from_tensors(config: LlamaConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's ``tensors`` (transformers' names) -> the loops' weights (the arrays are
    not copied). Rotary ``inv_freq`` buffers are ignored; with tied embeddings a stored
    ``lm_head.weight`` must equal ``model.embed_tokens.weight``. Raises ``ValueError`` naming
    the tensor: missing, unexpected, mis-shaped (both shapes) or an untied copy."""
    if config.model_type == "phi3":
        tensors = _unfused(config, tensors)
    weights: dict[str, np.ndarray] = {}
    lm_head = None
    for name, value in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            lm_head = value
            continue
        weights[name] = value
    check_weights(config, weights)
    if lm_head is not None and not np.array_equal(
        np.asarray(lm_head), np.asarray(weights["model.embed_tokens.weight"])
    ):
        raise ValueError(
            "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' although config.json "
            "ties the word embeddings (tie_word_embeddings=true)"
        )
    return weights


def _fused_parts(config: LlamaConfig, layer: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's fused tensors of ``layer`` -> ``(Llama name, rows)`` of each part, in order."""
    d, p = config.head_dim, f"model.layers.{layer}."
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    a, m = p + "self_attn.", p + "mlp."
    return {
        a + "qkv_proj.weight": ((a + "q_proj.weight", q), (a + "k_proj.weight", kv), (a + "v_proj.weight", kv)),
        m + "gate_up_proj.weight": ((m + "gate_proj.weight", inter), (m + "up_proj.weight", inter)),
    }


def _unfused(config: LlamaConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Phi-3's tensors with each fused projection split into the Llama names (row views, no copy)."""
    out = dict(tensors)
    for layer in range(config.num_hidden_layers):
        for fused, parts in _fused_parts(config, layer).items():
            if fused not in out:
                raise ValueError(f"weights lack tensor {fused!r}")
            value = out.pop(fused)
            rows = sum(n for _, n in parts)
            if tuple(np.shape(value)) != (rows, config.hidden_size):
                raise ValueError(
                    f"tensor {fused!r} must have shape {(rows, config.hidden_size)} for this config "
                    f"(got {tuple(np.shape(value))})"
                )
            start = 0
            for name, n in parts:
                out[name] = value[start : start + n]
                start += n
    return out


def to_hf(config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json mapping, tensors)`` of a Hugging Face checkpoint of ``weights``."""
    check_weights(config, weights)
    rope = rope_parameters(config)
    windows = set(config.layer_windows) - {0}
    hf = {
        "model_type": config.model_type,
        "architectures": [_ARCHITECTURES[config.model_type]],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope if config.rope_type != "default" else None,
        "rope_parameters": rope,
        "attention_bias": config.o_bias or (config.qkv_bias and config.model_type != "qwen2"),
        "mlp_bias": config.mlp_bias,
        "sliding_window": windows.pop() if windows else None,
        # no tokenizer: the model types' defaults name ids of their own vocabularies (Phi-3's 32000, ...)
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if config.model_type in _GEMMA:
        hf.update(
            hidden_activation=config.hidden_act,
            query_pre_attn_scalar=_number(config.query_pre_attn_scalar or config.head_dim),
            final_logit_softcapping=config.final_logit_softcapping or None,
            attn_logit_softcapping=config.attn_logit_softcapping or None,
        )
    if config.model_type in ("olmo3", "gemma3_text"):
        sliding = {"rope_type": "default", "rope_theta": config.sliding_rope_theta or config.rope_theta}
        hf.update(rope_parameters={"full_attention": rope, "sliding_attention": sliding}, rope_scaling=None)
    elif config.sliding_rope_theta:
        raise ValueError(f"a {config.model_type} checkpoint has one rotary embedding for all layers (this config: two)")
    if config.model_type == "smollm3":
        hf["no_rope_layers"] = [int(i not in config.nope_layers) for i in range(config.num_hidden_layers)]
    elif config.nope_layers:
        raise ValueError(f"a {config.model_type} checkpoint has rotary embeddings in every layer (this config: not)")
    if config.model_type in ("qwen2", "qwen3", "olmo3", "smollm3", "gemma2", "gemma3_text"):
        hf["use_sliding_window"] = hf["sliding_window"] is not None  # read by Qwen's configs alone
        hf["layer_types"] = [
            "sliding_attention" if config.window(i) else "full_attention" for i in range(config.num_hidden_layers)
        ]
    tensors = {name: np.asarray(weights[name]) for name in param_shapes(config)}
    if config.model_type == "phi3":
        if config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm:
            raise ValueError("a phi3 checkpoint holds no projection biases and no q/k norms: this config has some")
        for layer in range(config.num_hidden_layers):
            for fused, parts in _fused_parts(config, layer).items():
                tensors[fused] = np.concatenate([tensors.pop(name) for name, _ in parts])
    return hf, tensors
