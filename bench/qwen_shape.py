"""The models and workload that ``models.py``, ``multi_gpu.py`` and ``score.py`` share: a
Qwen2.5-0.5B-shaped random model (its tiny twin for ``--quick``), a Llama-3-8B-shaped one (and its
tiny twin), traced requests of random lengths, and pattern weights that cost the host almost
nothing whatever the model's size.

Pattern weights (:func:`pattern_weights`): a matrix ``[R, C]`` is ``W[i, j] = b[STRIDE * i + j]``
over one float32 vector ``b ~ N(0, 0.02^2)`` of ``STRIDE * (R - 1) + C`` values, given as a
read-only zero-copy numpy view (``as_strided``): the views of a Llama-3-8B shape hold about 50 MB,
not 32 GB, yet each is a real ``np.ndarray`` of the full shape, so the loops' checks pass
(``check_weights`` reads ``np.shape``, ``check_run`` ``np.asarray(w).dtype``, the memory estimate
``np.asarray(w).size``: none copies). Vectors are real arrays (norm gains ``1 + 0.05 b``, biases
``0.01 b``). The torch loop's ``LlamaTorch`` makes each tensor contiguous (``np.ascontiguousarray``,
float32) as it uploads it, one at a time (at most one tensor, 2.1 GB for the 8B's embedding or
``lm_head``, lives on the host). :func:`jax_pattern_params` builds the same values on the device,
in the JAX loop's parameter layout (``jax_loop._params``: projections transposed to ``[in, out]``,
q/k/v and gate/up concatenated), where ``_params`` itself would build a float32 host pytree of
every weight (32 GB for the 8B shape); :func:`check_jax_pattern` compares the two bit for bit on a
tiny config of the same options.
"""

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
# Llama-3-8B's shape (no rope scaling: Llama 3, not 3.1), the same lengths; and a tiny twin.
LLAMA3_8B: dict[str, Any] = dict(
    sizes=dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
    batches=(64,),
    prompt=FULL["prompt"],
    trace=FULL["trace"],
)
LLAMA3_QUICK: dict[str, Any] = dict(
    sizes=dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    batches=(4,),
    prompt=QUICK["prompt"],
    trace=QUICK["trace"],
)
QWEN2_OPTIONS: dict[str, Any] = dict(tie_word_embeddings=True, rope_theta=1e6)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", options=QWEN2_OPTIONS, full=FULL, quick=QUICK),
    "llama3-8b": dict(
        model_type="llama",
        options=dict(tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
        full=LLAMA3_8B,
        quick=LLAMA3_QUICK,
    ),
}
STRIDE = 7  # row i of a pattern matrix starts STRIDE values after row i - 1


def hf_config(sizes: dict[str, int], model_type: str = "qwen2", **options):
    """transformers' config of ``model_type`` with ``sizes`` and ``options`` (default: Qwen2's
    tied embeddings and ``rope_theta`` 1e6), no special tokens."""
    import transformers

    options = options or (QWEN2_OPTIONS if model_type == "qwen2" else {})
    return transformers.AutoConfig.for_model(
        model_type, **sizes, **options, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )


def hf_model(sizes: dict[str, int], device: str, model_type: str = "qwen2", **options):
    """transformers' model of ``sizes`` (:func:`hf_config`), bf16, random weights seeded with 0,
    built on ``device`` (``"cpu"`` or ``"cuda"``), in eval mode; returns ``(model, hf_config)``."""
    import torch
    import transformers

    config = hf_config(sizes, model_type, **options)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model, config


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


def hf_pattern_model(shape, sizes, config, device):
    """transformers' model of ``shape`` (a key of :data:`SHAPES`) of ``sizes`` on ``device``, bf16,
    with :func:`pattern_weights` of ``config`` (its ``LlamaConfig``) copied in, one float32 host
    tensor at a time (the model's own random initialisation runs on the device first)."""
    import torch
    import transformers

    spec = SHAPES[shape]
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(sizes, spec["model_type"], **spec["options"]), dtype=torch.bfloat16
        ).eval()
    params, weights = dict(model.named_parameters()), pattern_weights(config)
    assert set(params) == set(weights), sorted(set(params) ^ set(weights))[:5]
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return model


def floor_bytes(config, requests):
    """Bytes one decode step must read, averaged over the steps: every weight once (of an untied
    embedding only the ``B`` rows gathered) plus the KV cache the active rows hold (bf16)."""
    from trace_replay_app.models.llama.config import param_shapes

    weights = sum(int(np.prod(s)) for s in param_shapes(config).values())
    if not config.tie_word_embeddings:
        weights -= (config.vocab_size - len(requests)) * config.hidden_size
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    steps = max(len(r.trace) for r in requests)
    kv = 0
    for r in requests:
        n = len(r.trace)
        kv += per_token * (n * len(r.prompt) + n * (n - 1) / 2)  # positions held at steps 0 .. n-1
    return 2 * weights + kv / steps


def _base(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 N(0, 1) values behind parameter number ``index`` of ``shape``."""
    n = STRIDE * (shape[0] - 1) + shape[1] if len(shape) == 2 else shape[0]
    return np.random.default_rng([seed, index]).standard_normal(n, dtype=np.float32)


def _vector(name: str, base: np.ndarray) -> np.ndarray:
    return (1.0 + 0.05 * base) if name.endswith("norm.weight") else 0.01 * base


def pattern_weights(config, seed: int = 0) -> dict[str, np.ndarray]:
    """The loops' weights of ``config`` (a ``LlamaConfig``) as pattern views (module docstring):
    float32, every name of ``param_shapes``, matrices as read-only zero-copy views."""
    from trace_replay_app.models.llama.config import param_shapes

    out = {}
    for index, (name, shape) in enumerate(param_shapes(config).items()):
        base = _base(seed, index, shape)
        if len(shape) == 1:
            out[name] = _vector(name, base).astype(np.float32)
        else:
            base *= np.float32(0.02)
            out[name] = np.lib.stride_tricks.as_strided(base, shape, (STRIDE * 4, 4), writeable=False)
    return out


def jax_pattern_params(config, device, dtype, seed: int = 0) -> dict:
    """:func:`pattern_weights`' values as the JAX loop's parameter pytree (``jax_loop._params``
    with ``head=False``, cast to ``dtype`` as its ``device_params`` does), made on ``device`` (a
    JAX device): only each matrix's vector ``b`` crosses from the host."""
    import functools

    import jax
    import jax.numpy as jnp

    from trace_replay_app.models.llama.config import layer_norm_names, param_shapes

    shapes = param_shapes(config)
    index = {name: i for i, name in enumerate(shapes)}
    put = lambda x: jax.device_put(x, device)  # noqa: E731

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def grid(b, rows, cols):  # W[i, j] = b[STRIDE * i + j]
        return b[STRIDE * jnp.arange(rows)[:, None] + jnp.arange(cols)[None, :]]

    def mat(name):
        return grid(put(_base(seed, index[name], shapes[name]) * np.float32(0.02)), *shapes[name])

    def vec(names):
        return put(np.concatenate([_vector(n, _base(seed, index[n], shapes[n])) for n in names])).astype(dtype)

    def cat_t(names):  # concatenated along the output rows, transposed to [in, out], cast
        return jnp.concatenate([mat(n) for n in names]).T.astype(dtype)

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [a + n for n in ("q_proj", "k_proj", "v_proj")]
        layer = {
            **{role: vec([p + name + ".weight"]) for role, name in layer_norm_names(config).items()},
            "qkv_w": cat_t([n + ".weight" for n in qkv]),
            "o_w": cat_t([a + "o_proj.weight"]),
            "gu_w": cat_t([m + "gate_proj.weight", m + "up_proj.weight"]),
            "down_w": cat_t([m + "down_proj.weight"]),
        }
        optional = {
            "qkv_b": [n + ".bias" for n in qkv],
            "o_b": [a + "o_proj.bias"],
            "q_norm": [a + "q_norm.weight"],
            "k_norm": [a + "k_norm.weight"],
            "gu_b": [m + "gate_proj.bias", m + "up_proj.bias"],
            "down_b": [m + "down_proj.bias"],
        }
        layer.update({key: vec(names) for key, names in optional.items() if names[0] in shapes})
        layers.append(layer)
    params = {
        "layers": layers,
        "embed": mat("model.embed_tokens.weight").astype(dtype),
        "norm": vec(["model.norm.weight"]),
    }
    if config.final_logit_softcapping:
        params["logit_cap"] = put(np.float32(config.final_logit_softcapping)).astype(dtype)
    if not config.tie_word_embeddings:
        params["head"] = cat_t(["lm_head.weight"])
    return params


def check_jax_pattern(config, device) -> None:
    """Raise ``AssertionError`` unless :func:`jax_pattern_params` (float32) equals, tree and bits,
    what the JAX loop's own ``_params`` makes of :func:`pattern_weights` on a tiny config with
    ``config``'s options (model type, tied embeddings, biases, q/k norms)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from trace_replay_app.models.llama.jax_loop import JAX

    tiny = dataclasses.replace(
        config, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
        num_attention_heads=4, num_key_value_heads=2, layer_windows=(),
    )  # fmt: skip
    want = JAX.params(tiny, pattern_weights(tiny), False)
    got = jax.device_get(jax_pattern_params(tiny, device, jnp.float32))
    assert jax.tree.structure(got) == jax.tree.structure(want), "pytree layouts differ"
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and np.array_equal(g, w), f"leaf {jax.tree_util.keystr(path)} differs"
