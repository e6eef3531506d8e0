"""GPT-2-style model description shared by the torch and JAX reference decode loops (numpy only).

Parameters use the Hugging Face GPT-2 names without the ``transformer.`` prefix, with
Hugging Face's ``Conv1D`` layout (a projection is ``x @ weight + bias``, weight
``[in, out]``). The output projection is tied to ``wte.weight``. All weights are float32
numpy arrays owned by the caller; the loops copy them to their framework and device.

Checkpoints: :func:`config_from_hf` reads a Hugging Face ``GPT2LMHeadModel`` ``config.json``
(refusing options the loops do not implement), :func:`weights_from_tensors` maps its tensors to
these names (an optional ``transformer.`` prefix is dropped, the causal-mask buffers
``h.N.attn.bias`` / ``h.N.attn.masked_bias`` are ignored, ``lm_head.weight`` is accepted only
when it equals ``wte.weight``), and :func:`to_hf` is the way back (for tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..hf_fields import get_float

__all__ = [
    "GPT2Config",
    "param_shapes",
    "seeded_weights",
    "check_weights",
    "reference_logits",
    "config_from_hf",
    "weights_from_tensors",
    "to_hf",
    "describe",
]

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# config.json options whose other values the loops do not implement
_FIXED_OPTIONS = (
    ("activation_function", "gelu_new"),
    ("scale_attn_weights", True),
    ("scale_attn_by_inverse_layer_idx", False),
    ("reorder_and_upcast_attn", False),
    ("tie_word_embeddings", True),
)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Sizes of a GPT-2-style decoder (defaults: the tiny model of the demo and the tests).

    ``n_positions`` bounds prompt + generated tokens of one request. ``n_embd`` must be a
    multiple of ``n_head``.
    """

    vocab_size: int = 512
    n_positions: int = 128
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive int (got {value!r})")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config.n_embd must be a multiple of n_head (got n_embd={self.n_embd}, n_head={self.n_head})"
            )
        eps = self.layer_norm_epsilon
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < math.inf:
            raise ValueError(f"GPT2Config.layer_norm_epsilon must be a positive finite float (got {eps!r})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> GPT2Config:
        """From a Hugging Face GPT-2 ``config.json`` mapping (``n_ctx`` accepted for
        ``n_positions``); other keys are ignored."""
        fields = {
            "vocab_size": config.get("vocab_size"),
            "n_positions": config.get("n_positions", config.get("n_ctx")),
            "n_embd": config.get("n_embd"),
            "n_layer": config.get("n_layer"),
            "n_head": config.get("n_head"),
        }
        missing = [k for k, v in fields.items() if v is None]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        return cls(**fields, layer_norm_epsilon=get_float(config, "layer_norm_epsilon", 1e-5))

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` mapping of this model."""
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "tie_word_embeddings": True,
        }


def param_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name -> shape, in a fixed order."""
    e = config.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (config.vocab_size, config.n_embd),
        "wpe.weight": (config.n_positions, config.n_embd),
    }
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (e,),
                p + "ln_1.bias": (e,),
                p + "attn.c_attn.weight": (e, 3 * e),
                p + "attn.c_attn.bias": (3 * e,),
                p + "attn.c_proj.weight": (e, e),
                p + "attn.c_proj.bias": (e,),
                p + "ln_2.weight": (e,),
                p + "ln_2.bias": (e,),
                p + "mlp.c_fc.weight": (e, 4 * e),
                p + "mlp.c_fc.bias": (4 * e,),
                p + "mlp.c_proj.weight": (4 * e, e),
                p + "mlp.c_proj.bias": (e,),
            }
        )
    shapes.update({"ln_f.weight": (e,), "ln_f.bias": (e,)})
    return shapes


def seeded_weights(config: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``config`` from ``seed`` (identical on every machine:
    numpy's PCG64 stream). Matrices ~ N(0, 0.02^2) with residual projections scaled by
    1/sqrt(2 n_layer) as in GPT-2; LayerNorm gains near 1 and every bias small but non-zero,
    so that no parameter is trivially zero in a test."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(config).items():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            w = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.01 * rng.standard_normal(shape)
        else:
            scale = 0.02 / np.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            w = scale * rng.standard_normal(shape)
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def check_weights(config: GPT2Config, weights: Mapping[str, np.ndarray]) -> None:
    """Raise ``ValueError`` naming the first missing, unexpected or mis-shaped parameter."""
    shapes = param_shapes(config)
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"weights lack parameter {name!r} (shape {shape})")
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"weights[{name!r}] must have shape {shape} (got {got})")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ValueError(f"weights hold unexpected parameters {extra[:5]}")


def config_from_hf(hf: Mapping[str, Any]) -> GPT2Config:
    """The config of a Hugging Face GPT-2 ``config.json`` mapping; ``ValueError`` naming the key
    for missing sizes or an option the loops do not implement (e.g. another activation)."""
    config = GPT2Config.from_hf(hf)
    for key, supported in _FIXED_OPTIONS:
        if key in hf and hf[key] != supported:
            raise ValueError(
                f"{key}={hf[key]!r} is not supported (the reference loops implement GPT-2 with {key}={supported!r})"
            )
    return config


def weights_from_tensors(config: GPT2Config, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Hugging Face GPT-2 checkpoint's ``tensors`` -> this project's weights (the arrays are
    not copied). Raises ``ValueError`` naming the tensor: missing, unexpected, mis-shaped (both
    shapes), present with and without the ``transformer.`` prefix, or an untied ``lm_head``."""
    weights: dict[str, np.ndarray] = {}
    lm_head = None
    shapes = param_shapes(config)
    for name, value in tensors.items():
        short = name.removeprefix("transformer.")
        if short == "lm_head.weight":
            lm_head = value
        elif short.startswith("h.") and short.endswith(_IGNORED_SUFFIXES) and short not in shapes:
            continue
        elif short in weights:
            raise ValueError(f"tensor {short!r} appears twice (with and without the 'transformer.' prefix)")
        else:
            weights[short] = value
    check_weights(config, weights)
    if lm_head is not None and not np.array_equal(lm_head, weights["wte.weight"]):
        raise ValueError(
            "tensor 'lm_head.weight' differs from 'wte.weight' (the reference loops tie the output "
            "projection to the token embedding)"
        )
    return weights


def to_hf(
    config: GPT2Config,
    weights: Mapping[str, np.ndarray],
    *,
    prefix: str = "",
    tied_lm_head: bool = False,
    mask_buffers: bool = False,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json mapping, tensors)`` of a Hugging Face checkpoint of ``weights``: every name
    prefixed by ``prefix`` (e.g. ``"transformer."``), optionally with a tied ``lm_head.weight``
    and the causal-mask buffers Hugging Face stores."""
    check_weights(config, weights)
    tensors = {prefix + name: np.asarray(weights[name]) for name in param_shapes(config)}
    if mask_buffers:
        n = config.n_positions
        for i in range(config.n_layer):
            tensors[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((n, n), np.float32))[None, None]
            tensors[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if tied_lm_head:
        tensors["lm_head.weight"] = np.asarray(weights["wte.weight"])
    return config.to_hf(), tensors


def describe(config: GPT2Config) -> str:
    """The model's sizes in a few words."""
    return f"vocabulary {config.vocab_size}, {config.n_layer} layers, width {config.n_embd}"


def _layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gain + bias


def _gelu_new(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def reference_logits(config: GPT2Config, weights: Mapping[str, np.ndarray], tokens) -> np.ndarray:
    """Logits ``[len(tokens), vocab_size]`` (float64) of the model over ``tokens``: row ``i``
    scores the token that follows ``tokens[: i + 1]``.

    The plain reference the decode loops are tested against: a full causal forward over the
    whole sequence in float64 numpy, no KV cache, no batching, written straight from the model
    description (pre-LayerNorm blocks, ``gelu_new``, learned positions, final ``ln_f``, logits
    ``= h @ wte.T``). ``tokens``: 1-D integer ids in ``[0, vocab_size)``, at least one, at most
    ``n_positions``. Host-only; slow by design (recompute everything): for tests and checks.
    """
    check_weights(config, weights)
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a non-empty 1-D sequence of ints (got {ids.dtype}{list(ids.shape)})")
    if ids.size > config.n_positions:
        raise ValueError(f"tokens hold {ids.size} ids, more than config.n_positions={config.n_positions}")
    bad = np.nonzero((ids < 0) | (ids >= config.vocab_size))[0]
    if bad.size:
        raise ValueError(f"tokens[{bad[0]}]={ids[bad[0]]} is outside [0, vocab_size={config.vocab_size})")
    w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}
    n, e, heads, d = ids.size, config.n_embd, config.n_head, config.head_dim
    eps = config.layer_norm_epsilon
    causal = np.tril(np.ones((n, n), dtype=bool))
    x = w["wte.weight"][ids] + w["wpe.weight"][:n]
    for layer in range(config.n_layer):
        p = f"h.{layer}."
        h = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, i * e : (i + 1) * e].reshape(n, heads, d).transpose(1, 0, 2) for i in range(3))
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(d), -np.inf)  # [heads, n, n]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, e)
        x = x + attn @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        x = (
            x
            + _gelu_new(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]) @ w[p + "mlp.c_proj.weight"]
            + w[p + "mlp.c_proj.bias"]
        )
    return _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps) @ w["wte.weight"].T
