"""Llama-family model description shared by the torch and JAX decode loops (numpy only).

One config serves the Hugging Face ``model_type`` values ``llama`` (Llama 2/3/3.1), ``mistral``
(the same layout, with a sliding attention window), ``qwen2`` (biases on q/k/v), ``qwen3``
(per-head RMSNorm on q and k, an explicit ``head_dim``), ``phi3`` (Phi-3 and Phi-4: the
Llama layout saved with fused q/k/v and gate/up projections, which ``hf.py`` splits),
``olmo2`` (OLMo 2: RMSNorm on each sublayer's output instead of its input, and on the whole
q and k projections), ``olmo3`` (OLMo 2's layers, three of every four with a sliding window
and plain rotary embeddings), ``smollm3`` (every fourth layer without rotary embeddings),
``gemma2`` (Gemma 2: as Gemma 3 without q/k norms, every other
layer with a window, scores and logits soft-capped) and ``gemma3_text`` (Gemma 3: norms on each
sublayer's input and output scaling by ``1 + weight``, per-head q/k norms, a GELU-gated MLP,
embeddings scaled by ``sqrt(hidden_size)``, five of every six layers with a sliding window and
their own rotary base). The Llama block: RMSNorm, grouped-query attention with rotary embeddings
(``rope_theta``; ``rope_scaling`` none, ``default``, ``linear``, ``llama3`` or ``yarn``),
RMSNorm, SwiGLU MLP; a final RMSNorm and the output projection (``lm_head``, or the token
embedding when tied).

Parameters keep the names and shapes transformers saves (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight`` ``[heads * head_dim, hidden]``, ...,
``lm_head.weight`` unless tied): a projection is ``x @ weight.T + bias``. Weights are float
numpy arrays owned by the caller; the loops copy them to their framework, device and compute
dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "LlamaConfig",
    "MODEL_TYPES",
    "ROPE_TYPES",
    "default_config",
    "param_shapes",
    "seeded_weights",
    "check_weights",
    "describe",
    "inv_freq",
    "yarn_attention_factor",
    "layer_norm_names",
]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "olmo3", "smollm3", "gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NORM_PLACEMENTS = ("pre", "post", "both")
NORM_STYLES = ("llama", "olmo", "gemma")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int (got {value!r})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama-family decoder (defaults: a tiny model for seeded runs).

    ``head_dim`` 0 means ``hidden_size // num_attention_heads``. ``num_attention_heads`` must
    be a multiple of ``num_key_value_heads`` (grouped-query attention). Rotary scaling as
    transformers computes it (:func:`inv_freq`): ``rope_type`` ``"linear"`` divides the
    frequencies by ``rope_factor``; ``"llama3"`` uses ``rope_factor``, ``rope_low_freq_factor``,
    ``rope_high_freq_factor`` and ``rope_original_max_positions``; ``"yarn"`` uses
    ``rope_factor``, ``rope_original_max_positions``, ``rope_beta_fast``, ``rope_beta_slow`` and
    ``rope_truncate``, and scales cos and sin by ``rope_attention_factor`` (0, the default:
    YaRN's :func:`yarn_attention_factor`; the other types keep 1). ``sliding_rope_theta``
    (OLMo 3, Gemma 3): the layers with a sliding window use plain rotary embeddings at this base
    instead (0: every layer the same). ``qkv_bias``/``o_bias``/``mlp_bias``: biases on the
    q/k/v, output and MLP projections; ``qk_norm``: RMSNorm over each head of q and k (Qwen3).
    ``norm_placement``: where a layer's RMSNorms sit, ``"pre"`` on the attention's and the MLP's
    inputs (Llama: ``input_layernorm``, ``post_attention_layernorm``), ``"post"`` on their outputs
    before the residual add (OLMo: ``post_attention_layernorm``, ``post_feedforward_layernorm``)
    or ``"both"`` (Gemma 3: ``input_layernorm``, ``post_attention_layernorm``,
    ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); :func:`layer_norm_names`.
    ``norm_style``: how every RMSNorm scales, ``"llama"`` (rounded to the activations' dtype,
    then times the weight), ``"olmo"`` (times the weight in float32, then rounded; ``qk_norm`` is
    then over the whole q and k projections, all heads at once) or ``"gemma"`` (times ``1 +
    weight`` in float32, then rounded). ``hidden_act``: the MLP gate's activation, ``"silu"`` or
    ``"gelu_pytorch_tanh"``; ``embed_scale``: token embeddings times ``sqrt(hidden_size)``
    (rounded to the compute dtype; Gemma); ``query_pre_attn_scalar``: attention scores scale by
    its inverse square root (0: ``head_dim``'s). ``attn_logit_softcapping`` /
    ``final_logit_softcapping`` (Gemma 2): scores / logits ``x`` become ``c * tanh(x / c)`` in the
    compute dtype (0: none; capped scores leave flash and cuDNN attention for the masked form).
    ``layer_windows``: per layer, the sliding attention window in tokens (a query at position
    ``p`` sees keys at ``p - window < k <= p``) or 0 for full causal attention; empty: none.
    ``nope_layers``: the layers without rotary embeddings (SmolLM3's). ``n_positions`` (the
    most prompt + decoded tokens of one request) is ``max_position_embeddings``. Frozen, hashable.
    """

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 0.0
    sliding_rope_theta: float = 0.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_placement: str = "pre"
    norm_style: str = "llama"
    hidden_act: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    layer_windows: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self):
        owner = "LlamaConfig"
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"{owner}.model_type must be one of {', '.join(MODEL_TYPES)} (got {self.model_type!r})")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_original_max_positions",
        ):
            _positive_int(owner, name, getattr(self, name))
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"{owner}.hidden_size must be a multiple of num_attention_heads when head_dim is "
                    f"not given (got {self.hidden_size} and {self.num_attention_heads})"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _positive_int(owner, "head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"{owner}.head_dim must be even for rotary embeddings (got {self.head_dim})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{owner}.num_attention_heads must be a multiple of num_key_value_heads "
                f"(got {self.num_attention_heads} and {self.num_key_value_heads})"
            )
        positive = ("rms_norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor")
        for name in positive + ("rope_beta_fast", "rope_beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{owner}.{name} must be a positive finite number (got {value!r})")
            object.__setattr__(self, name, float(value))
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"{owner}.rope_type must be one of {', '.join(ROPE_TYPES)} (got {self.rope_type!r})")
        if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError(
                f"{owner}.rope_high_freq_factor must exceed rope_low_freq_factor (got "
                f"{self.rope_high_freq_factor} and {self.rope_low_freq_factor})"
            )
        if not isinstance(self.rope_truncate, bool):
            raise ValueError(f"{owner}.rope_truncate must be True or False (got {self.rope_truncate!r})")
        a = self.rope_attention_factor
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < math.inf:
            raise ValueError(f"{owner}.rope_attention_factor must be a finite number >= 0 (got {a!r})")
        if a == 0:
            a = yarn_attention_factor(self.rope_factor) if self.rope_type == "yarn" else 1.0
        elif self.rope_type != "yarn" and a != 1:
            raise ValueError(
                f"{owner}.rope_attention_factor applies to rope_type 'yarn' only (got {a!r} with {self.rope_type!r})"
            )
        object.__setattr__(self, "rope_attention_factor", float(a))
        for name, allowed in (
            ("norm_placement", NORM_PLACEMENTS),
            ("norm_style", NORM_STYLES),
            ("hidden_act", HIDDEN_ACTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{owner}.{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if not isinstance(self.embed_scale, bool):
            raise ValueError(f"{owner}.embed_scale must be True or False (got {self.embed_scale!r})")
        for name in (
            "query_pre_attn_scalar",
            "sliding_rope_theta",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
                raise ValueError(f"{owner}.{name} must be a finite number >= 0 (got {t!r})")
            object.__setattr__(self, name, float(t))
        windows = tuple(self.layer_windows)
        if windows and len(windows) != self.num_hidden_layers:
            raise ValueError(
                f"{owner}.layer_windows must hold one window per layer ({self.num_hidden_layers}) or "
                f"none (got {len(windows)})"
            )
        for w in windows:
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
                raise ValueError(f"{owner}.layer_windows must hold ints >= 0 (0 = full attention) (got {w!r})")
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in windows) if any(windows) else ())
        layers = range(self.num_hidden_layers)
        if any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i not in layers for i in self.nope_layers
        ):
            raise ValueError(f"{owner}.nope_layers must hold layer indices (got {self.nope_layers!r})")
        object.__setattr__(self, "nope_layers", tuple(sorted({int(i) for i in self.nope_layers})))

    @property
    def n_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens, 0 for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else 0


_GEMMA: dict[str, Any] = dict(
    norm_placement="both", norm_style="gemma", hidden_act="gelu_pytorch_tanh", embed_scale=True, head_dim=32,
    query_pre_attn_scalar=32.0, tie_word_embeddings=True, layer_windows=(32, 0),
)  # fmt: skip
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_positions=64,
        rope_theta=500000.0,
    ),  # fmt: skip
    "mistral": dict(layer_windows=(32, 32)),
    "qwen2": dict(qkv_bias=True, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(qk_norm=True, head_dim=32, rope_theta=1000000.0),
    "phi3": dict(rope_theta=250000.0),
    "olmo2": dict(norm_placement="post", norm_style="olmo", qk_norm=True, rope_theta=500000.0),
    "olmo3": dict(norm_placement="post", norm_style="olmo", qk_norm=True, rope_theta=500000.0, layer_windows=(32, 0)),
    "smollm3": dict(tie_word_embeddings=True, rope_theta=5000000.0, nope_layers=(1,)),
    "gemma2": dict(_GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(_GEMMA, qk_norm=True, rope_theta=1000000.0, sliding_rope_theta=10000.0),
}


def layer_norm_names(config: LlamaConfig) -> dict[str, str]:
    """A layer's RMSNorms of ``config.norm_placement`` by role (``attention_in``/``_out``,
    ``mlp_in``/``_out``) -> their checkpoint names (``model.layers.N.<name>.weight``)."""
    if config.norm_placement == "pre":
        return {"attention_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
    out = {"attention_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}
    if config.norm_placement == "both":
        out.update(attention_in="input_layernorm", mlp_in="pre_feedforward_layernorm")
    return out


def default_config(model_type: str = "llama") -> LlamaConfig:
    """A small config of ``model_type`` for seeded runs (vocabulary 512, 2 layers, width 64, 4
    query and 2 key/value heads, 256 positions, the model type's options)."""
    if model_type not in _DEFAULTS:
        raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)} (got {model_type!r})")
    return LlamaConfig(model_type=model_type, **_DEFAULTS[model_type])


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name -> shape, in a fixed order (the names transformers saves)."""
    h, d, v, inter = config.hidden_size, config.head_dim, config.vocab_size, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, h)
            if config.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            whole = config.norm_style == "olmo"
            shapes[p + "self_attn.q_norm.weight"] = (q,) if whole else (d,)
            shapes[p + "self_attn.k_norm.weight"] = (kv,) if whole else (d,)
        for name in layer_norm_names(config).values():
            shapes[p + name + ".weight"] = (h,)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def seeded_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``config`` from ``seed`` (numpy's PCG64 stream, the
    same on every machine): matrices ~ N(0, 0.02^2), norm gains near 1, biases small but
    non-zero, so that no parameter is trivially zero in a test."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.01 * rng.standard_normal(shape)
        else:
            w = 0.02 * rng.standard_normal(shape)
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def check_weights(config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` naming the first missing, unexpected or mis-shaped parameter (with
    the shape the config wants and the one received)."""
    shapes = param_shapes(config)
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"weights lack tensor {name!r} (shape {shape} for this config)")
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"tensor {name!r} must have shape {shape} for this config (got {got})")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ValueError(f"weights hold tensors this config does not use: {extra[:5]}")


def describe(config: LlamaConfig) -> str:
    """The model's type and sizes in a few words."""
    return (
        f"{config.model_type}, vocabulary {config.vocab_size}, {config.num_hidden_layers} layers, width "
        f"{config.hidden_size}, {config.num_attention_heads}/{config.num_key_value_heads} query/key-value heads"
        f"{', tied embeddings' if config.tie_word_embeddings else ''}"
    )


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's scale of cos and sin for a context stretched ``factor`` times: ``0.1 * mscale *
    ln(factor) + 1``, or 1 when ``factor <= 1`` (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(config: LlamaConfig, sliding: bool = False) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim // 2]`` float32, as transformers computes them
    (``theta ** -(2i / head_dim)``, then the rope type's rescaling: ``linear`` divides all by
    ``rope_factor``; ``llama3`` and ``yarn`` divide the long wavelengths by it, keep the short
    ones and blend those between), here in float64 and rounded once. A position ``p`` rotates
    pair ``i`` by ``p * inv_freq[i]`` radians (that product in float32, as transformers does).
    ``sliding``: those of the layers with a sliding window (with ``sliding_rope_theta``: plain,
    at that base)."""
    d = config.head_dim
    if sliding and config.sliding_rope_theta:
        return (1.0 / config.sliding_rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)
    freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if config.rope_type == "linear":
        freq = freq / config.rope_factor
    elif config.rope_type == "yarn":  # a linear ramp over the pairs between beta_fast and beta_slow rotations
        old = float(config.rope_original_max_positions)

        def pair_at(rotations: float) -> float:  # the (fractional) dimension that turns `rotations` times
            return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = pair_at(config.rope_beta_fast), pair_at(config.rope_beta_slow)
        if config.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        kept = 1 - np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        freq = freq / config.rope_factor * (1 - kept) + freq * kept
    elif config.rope_type == "llama3":
        old = float(config.rope_original_max_positions)
        low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_factor
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > old / low, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        freq = np.where(medium, smoothed, scaled)
    return freq.astype(np.float32)
