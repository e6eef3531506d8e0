"""The rotary options of a Hugging Face ``config.json`` (Llama family): the keys transformers
reads for each rope type, to :class:`~.config.LlamaConfig`'s fields and back (host-only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_fields import get_float, get_int, get_mapping
from .config import ROPE_TYPES, LlamaConfig, yarn_attention_factor

__all__ = ["rope_options", "layered_rope_options", "rope_parameters"]


def rope_options(hf: Mapping[str, Any], default_theta: float = 1e4) -> dict[str, Any]:
    """The rotary options of ``hf`` as :class:`~.config.LlamaConfig` fields: transformers 5 writes
    ``rope_parameters``, older files ``rope_theta`` (else ``default_theta``) and ``rope_scaling``
    (``"type"`` or ``"rope_type"``)."""
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
        else get_float(hf, "rope_theta", default_theta)
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


def layered_rope_options(hf: Mapping[str, Any], gemma: bool = False, default_theta: float = 1e4) -> dict[str, Any]:
    """OLMo 3's and Gemma 3's rotary options, per layer type: ``rope_parameters`` as
    ``{"full_attention": ..., "sliding_attention": ...}`` (older files: ``rope_scaling`` for the
    full layers; ``rope_theta``, else ``default_theta``, for both, or with ``gemma`` for the full
    layers, default 1e6, and ``rope_local_base_freq`` for the sliding ones, default 1e4). The
    full layers' options are the config's; the sliding layers must use plain rotary embeddings,
    at ``sliding_rope_theta`` when that differs from the full layers' (as transformers, YaRN's
    ``truncate`` is read from the top of ``rope_parameters``: true)."""
    params = get_mapping(hf, "rope_parameters")
    if "full_attention" not in params and "sliding_attention" not in params:
        full = rope_options(hf, 1e6 if gemma else default_theta)
        theta = get_float(hf, "rope_local_base_freq", 1e4) if gemma else full["rope_theta"]
        sliding = {"rope_type": "default", "rope_theta": theta}
    else:
        full_params = dict(get_mapping(params, "full_attention"), truncate=params.get("truncate", True))
        full = rope_options({**hf, "rope_parameters": full_params, "rope_scaling": None}, default_theta)
        sliding = get_mapping(params, "sliding_attention")
    kind = sliding.get("rope_type", sliding.get("type", "default")) or "default"
    if kind != "default":
        raise ValueError(f"rope_parameters.sliding_attention type {kind!r} is not supported (supported: default)")
    theta = get_float(sliding, "rope_theta", full["rope_theta"], name="rope_parameters.sliding_attention.rope_theta")
    if full["rope_type"] != "default" or theta != full["rope_theta"]:
        full["sliding_rope_theta"] = theta
    return full


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


# The LlamaConfig field behind each key transformers reads for a rope type (written by rope_parameters).
_WRITTEN = {
    "linear": {"factor": "rope_factor"},
    "yarn": {
        "factor": "rope_factor",
        "original_max_position_embeddings": "rope_original_max_positions",
        "beta_fast": "rope_beta_fast",
        "beta_slow": "rope_beta_slow",
        "truncate": "rope_truncate",
        "attention_factor": "rope_attention_factor",
    },
    "llama3": {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_positions",
    },
}


def rope_parameters(config: LlamaConfig) -> dict[str, Any]:
    """``config``'s rotary options as transformers' ``rope_parameters`` (the full layers')."""
    rope: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    rope.update({key: getattr(config, field) for key, field in _WRITTEN.get(config.rope_type, {}).items()})
    return rope
