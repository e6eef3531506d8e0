"""The Llama family and Hugging Face checkpoints: ``config.json`` -> :class:`~.config.LlamaConfig`,
a checkpoint's tensors -> the loops' weights, and back (numpy only; host-only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..hf_fields import get_bool, get_float, get_int, get_mapping
from .config import MODEL_TYPES, ROPE_TYPES, LlamaConfig, check_weights, param_shapes, yarn_attention_factor

__all__ = ["config_from_hf", "weights_from_tensors", "to_hf"]

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_ATTENTION_BIAS = ("llama", "qwen3", "olmo2", "olmo3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")  # attention_bias: q/k/v and output biases
# What transformers' config class of a model type assumes for a key config.json leaves out,
# where it differs from the Llama defaults (1e-6, hidden_size // heads, 10,000, no window, as
# many key/value heads as query heads).
_ABSENT: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32},
    "phi3": {"rms_norm_eps": 1e-5},
    "olmo2": {"rms_norm_eps": 1e-5},
    "olmo3": {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "sliding_window": 4096},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "num_key_value_heads": 4}
    | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 256, "sliding_window": 4096, "num_key_value_heads": 4},
}
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)  # a buffer older checkpoints store


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary options of ``hf``: transformers 5 writes ``rope_parameters``, older files
    ``rope_theta`` and ``rope_scaling`` (``"type"`` or ``"rope_type"``)."""
    params = get_mapping(hf, "rope_parameters")
    scaling = get_mapping(hf, "rope_scaling")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: none, {', '.join(ROPE_TYPES)})")
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (rotary over the whole head only)")
    where = "rope_parameters" if "rope_theta" in params else ("rope_scaling" if "rope_theta" in scaling else "")
    theta = (
        get_float(merged, "rope_theta", name=f"{where}.rope_theta")
        if where
        else get_float(hf, "rope_theta", _absent(hf, "rope_theta", 1e4))
    )
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
    if rope_type == "linear":
        out["rope_factor"] = _factor(merged, "linear")
    elif rope_type == "yarn":
        out.update(_yarn(hf, merged))
    elif rope_type == "llama3":
        for key, field in (
            ("factor", "rope_factor"),
            ("low_freq_factor", "rope_low_freq_factor"),
            ("high_freq_factor", "rope_high_freq_factor"),
        ):
            if merged.get(key) is None:
                raise ValueError(f"rope_scaling type 'llama3' lacks {key!r}")
            out[field] = get_float(merged, key, name=f"rope_scaling.{key}")
        out["rope_original_max_positions"] = _original_positions(hf, merged)
    return out


def _layered_rope(hf: Mapping[str, Any], gemma: bool = False) -> dict[str, Any]:
    """OLMo 3's and Gemma 3's rotary options, per layer type: ``rope_parameters`` as
    ``{"full_attention": ..., "sliding_attention": ...}`` (older files: ``rope_scaling`` for the
    full layers; ``rope_theta`` for both, or with ``gemma`` for the full layers, default 1e6,
    and ``rope_local_base_freq`` for the sliding ones, default 1e4). The full layers' options
    are the config's; the sliding layers must use plain rotary embeddings, at
    ``sliding_rope_theta`` when that differs from the full layers' (as transformers, YaRN's
    ``truncate`` is read from the top of ``rope_parameters``: true)."""
    params = get_mapping(hf, "rope_parameters")
    if "full_attention" not in params and "sliding_attention" not in params:
        full = _rope({**hf, "rope_theta": get_float(hf, "rope_theta", 1e6)} if gemma else hf)
        theta = (
            get_float(hf, "rope_local_base_freq", 1e4)
            if gemma
            else get_float(hf, "rope_theta", _absent(hf, "rope_theta", 1e4))
        )
        sliding = {"rope_type": "default", "rope_theta": theta}
    else:
        full_params = dict(get_mapping(params, "full_attention"), truncate=params.get("truncate", True))
        full = _rope({**hf, "rope_parameters": full_params, "rope_scaling": None})
        sliding = get_mapping(params, "sliding_attention")
    kind = sliding.get("rope_type", sliding.get("type", "default")) or "default"
    if kind != "default":
        raise ValueError(f"rope_parameters.sliding_attention type {kind!r} is not supported (supported: default)")
    theta = get_float(sliding, "rope_theta", full["rope_theta"], name="rope_parameters.sliding_attention.rope_theta")
    if full["rope_type"] != "default" or theta != full["rope_theta"]:
        full["sliding_rope_theta"] = theta
    return full


def _absent(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value transformers assumes for ``key`` when ``hf`` (a model type's config.json) lacks it."""
    return _ABSENT.get(hf.get("model_type", ""), {}).get(key, default)


def _factor(merged: Mapping[str, Any], rope_type: str) -> float:
    if merged.get("factor") is None:
        raise ValueError(f"rope_scaling type {rope_type!r} lacks 'factor'")
    return get_float(merged, "factor", name="rope_scaling.factor")


def _yarn(hf: Mapping[str, Any], merged: Mapping[str, Any]) -> dict[str, Any]:
    """YaRN's options as transformers reads them: ``factor``, ``original_max_position_embeddings``
    (else ``max_position_embeddings``), ``beta_fast``/``beta_slow``
    (missing, null or 0: 32 and 1), ``truncate`` (default true), and ``attention_factor`` (else
    from ``mscale``/``mscale_all_dim`` when both are set, else from ``factor``)."""
    factor = _factor(merged, "yarn")
    out = {"rope_original_max_positions": _original_positions(hf, merged), "rope_factor": factor}
    for key, field in (("beta_fast", "rope_beta_fast"), ("beta_slow", "rope_beta_slow")):
        if merged.get(key):
            out[field] = get_float(merged, key, name=f"rope_scaling.{key}")
    truncate = merged.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"rope_scaling.truncate must be true or false (got {truncate!r})")
    out["rope_truncate"] = truncate is not False
    if merged.get("attention_factor") is not None:
        out["rope_attention_factor"] = _positive(merged, "attention_factor")
    elif merged.get("mscale") and merged.get("mscale_all_dim"):
        scale = [_positive(merged, key) for key in ("mscale", "mscale_all_dim")]
        out["rope_attention_factor"] = yarn_attention_factor(factor, scale[0]) / yarn_attention_factor(factor, scale[1])
    return out


def _number(value: float) -> int | float:
    """``value`` as JSON writes it for transformers' typed configs: an int when it is one."""
    return int(value) if float(value).is_integer() else value


def _positive(merged: Mapping[str, Any], key: str) -> float:
    value = get_float(merged, key, name=f"rope_scaling.{key}")
    if not 0 < value < float("inf"):
        raise ValueError(f"rope_scaling.{key} must be a positive finite number (got {value!r})")
    return value


def _original_positions(hf: Mapping[str, Any], merged: Mapping[str, Any]) -> int:
    """``original_max_position_embeddings`` of the rope options, else ``max_position_embeddings``."""
    key = "original_max_position_embeddings"
    if merged.get(key):
        return get_int(merged, key, name=f"rope_scaling.{key}")
    return get_int(hf, "max_position_embeddings", required=True)


def _windows(hf: Mapping[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
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
    placement = "post" if olmo else ("both" if gemma else "pre")
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
        tie_word_embeddings=get_bool(hf, "tie_word_embeddings") if hf.get("tie_word_embeddings") is not None else gemma,
        qkv_bias=True if model_type == "qwen2" else attention_bias and model_type in _ATTENTION_BIAS,
        o_bias=attention_bias and model_type in _ATTENTION_BIAS,
        mlp_bias=get_bool(hf, "mlp_bias") and model_type == "llama",
        qk_norm=model_type in ("qwen3", "olmo2", "olmo3", "gemma3_text"),  # not gemma2
        norm_placement=placement,
        norm_style="olmo" if olmo else ("gemma" if gemma else "llama"),
        hidden_act=act,
        embed_scale=gemma,
        query_pre_attn_scalar=get_float(hf, "query_pre_attn_scalar", 256.0) if gemma else 0.0,
        layer_windows=_windows(hf, model_type, layers),
        **caps,
        **(_layered_rope(hf, gemma) if model_type in ("olmo3", "gemma3_text") else _rope(hf)),
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
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "linear":
        rope.update(factor=config.rope_factor)
    elif config.rope_type == "yarn":
        rope.update(
            factor=config.rope_factor,
            original_max_position_embeddings=config.rope_original_max_positions,
            beta_fast=config.rope_beta_fast,
            beta_slow=config.rope_beta_slow,
            truncate=config.rope_truncate,
            attention_factor=config.rope_attention_factor,
        )
    elif config.rope_type == "llama3":
        rope.update(
            factor=config.rope_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_positions,
        )
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
    }
    if config.model_type in _GEMMA:
        hf.update(
            hidden_activation=config.hidden_act,
            query_pre_attn_scalar=_number(config.query_pre_attn_scalar or config.head_dim),
            final_logit_softcapping=config.final_logit_softcapping or None,
            attn_logit_softcapping=config.attn_logit_softcapping or None,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
    if config.model_type in ("olmo3", "gemma3_text"):
        sliding = {"rope_type": "default", "rope_theta": config.sliding_rope_theta or config.rope_theta}
        hf.update(rope_parameters={"full_attention": rope, "sliding_attention": sliding}, rope_scaling=None)
    elif config.sliding_rope_theta:
        raise ValueError(f"a {config.model_type} checkpoint has one rotary embedding for all layers (this config: two)")
    if config.model_type in ("qwen2", "qwen3", "olmo3", "gemma2", "gemma3_text"):
        hf["use_sliding_window"] = hf["sliding_window"] is not None  # read by Qwen's configs alone
        hf["layer_types"] = [
            "sliding_attention" if config.window(i) else "full_attention" for i in range(config.num_hidden_layers)
        ]
    tensors = {name: np.asarray(weights[name]) for name in param_shapes(config)}
    if config.model_type == "phi3":
        hf.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # its defaults name Phi-3's vocabulary
        if config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm:
            raise ValueError("a phi3 checkpoint holds no projection biases and no q/k norms: this config has some")
        for layer in range(config.num_hidden_layers):
            for fused, parts in _fused_parts(config, layer).items():
                tensors[fused] = np.concatenate([tensors.pop(name) for name, _ in parts])
    return hf, tensors
