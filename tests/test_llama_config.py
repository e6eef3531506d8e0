"""The Llama-family config and weights (numpy only), checked against transformers' own configs
and models: parameter names and shapes, rotary frequencies, refusals of unsupported options and
bad checkpoints (the message names the tensor and both shapes), the registry entries."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import transformers
from helpers.llama_cases import _SIZES, CASES, make_checkpoint  # noqa: E402

from trace_replay_app.models import family_for_model_type, get_family, supported_model_types
from trace_replay_app.models.llama.config import (
    MODEL_TYPES,
    LlamaConfig,
    check_weights,
    default_config,
    inv_freq,
    param_shapes,
    seeded_weights,
)
from trace_replay_app.models.llama.hf import config_from_hf, to_hf, weights_from_tensors


def _hf(case):
    model_type, options, _ = CASES[case]
    return transformers.AutoConfig.for_model(model_type, **_SIZES, **options)


@pytest.mark.parametrize("case", sorted(CASES))
def test_names_and_shapes_are_transformers(case):
    hf = _hf(case)
    config = config_from_hf(hf.to_dict())
    model = transformers.AutoModelForCausalLM.from_config(hf)
    saved = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        saved.pop("lm_head.weight")  # transformers does not save the tied copy
    ours = to_hf(config, seeded_weights(config))[1]
    assert {k: v.shape for k, v in ours.items()} == saved
    if config.model_type != "phi3":  # the loops' names are transformers' (phi3: its fused tensors split)
        assert param_shapes(config) == saved


@pytest.mark.parametrize("case", sorted(CASES))
def test_rotary_frequencies_are_transformers(case):
    # transformers computes them in float32, here in float64 rounded once: a few float32 steps apart
    hf = _hf(case)
    config = config_from_hf(hf.to_dict())
    rotary = transformers.AutoModelForCausalLM.from_config(hf).model.rotary_emb
    if hasattr(rotary, "full_attention_inv_freq"):  # one rotary embedding per layer type (OLMo 3)
        for sliding, kind in ((False, "full_attention"), (True, "sliding_attention")):
            np.testing.assert_allclose(inv_freq(config, sliding), getattr(rotary, f"{kind}_inv_freq"), rtol=5e-7)
        assert config.sliding_rope_theta and not np.allclose(inv_freq(config, True), inv_freq(config))
        scale = rotary.full_attention_attention_scaling
        assert rotary.sliding_attention_attention_scaling == 1.0
    else:
        np.testing.assert_allclose(inv_freq(config), rotary.inv_freq.numpy(), rtol=5e-7)
        scale = rotary.attention_scaling
    assert config.rope_attention_factor == pytest.approx(scale, rel=1e-12)


_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48, "rope_theta": 500.0}


@pytest.mark.parametrize(
    "options",
    [
        _YARN,
        dict(_YARN, truncate=False, beta_fast=16.0, beta_slow=2.0),
        dict(_YARN, attention_factor=0.75),
        dict(_YARN, mscale=0.5, mscale_all_dim=2.0),
        dict(_YARN, factor=1.0),  # no stretch: attention factor 1, frequencies unchanged
        {k: v for k, v in _YARN.items() if k != "original_max_position_embeddings"},  # max_position_embeddings
        {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0},
    ],
    ids=["yarn", "untruncated-betas", "attention-factor", "mscale", "factor-1", "no-original", "linear"],
)
def test_rope_scaling_is_transformers(options):
    """Every YaRN option (and linear scaling): frequencies and cos/sin scale equal transformers'
    own rotary embedding of the same config.json."""
    hf = transformers.AutoConfig.for_model("qwen3", **_SIZES, head_dim=32, rope_parameters=dict(options))
    config = config_from_hf(hf.to_dict())
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf)
    np.testing.assert_allclose(inv_freq(config), rotary.inv_freq.numpy(), rtol=5e-7)
    assert config.rope_attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    again = config_from_hf(to_hf(config, seeded_weights(config))[0])  # and back through config.json
    assert again == config


def test_options_per_model_type():
    c = config_from_hf(_hf("qwen3").to_dict())
    assert (c.qk_norm, c.head_dim, c.qkv_bias, c.o_bias) == (True, 32, False, False)
    c = config_from_hf(_hf("qwen2").to_dict())
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings, c.layer_windows) == (True, False, True, ())
    c = config_from_hf(_hf("mistral-window-bf16").to_dict())
    assert c.layer_windows == (6, 6) and c.window(1) == 6
    c = config_from_hf(_hf("llama-untied-llama3-biases").to_dict())
    assert (c.rope_type, c.rope_factor, c.rope_original_max_positions) == ("llama3", 8.0, 64)
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (True, True, True)
    # Qwen sliding windows: only with use_sliding_window, from max_window_layers on.
    hf = dict(_hf("qwen2").to_dict(), use_sliding_window=True, sliding_window=5, max_window_layers=1)
    hf.pop("layer_types", None)
    assert config_from_hf(hf).layer_windows == (0, 5)


def test_old_style_rope_keys():
    hf = dict(_hf("llama-tied-llama3-sharded").to_dict())
    hf.pop("rope_parameters")
    hf.update(
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    c = config_from_hf(hf)
    assert (c.rope_theta, c.rope_type, c.rope_factor, c.rope_original_max_positions) == (500000.0, "llama3", 4.0, 32)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "bert"}, r"model_type 'bert' is not supported .*llama, mistral, qwen2, qwen3"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
            r"rope_scaling type 'dynamic' is not supported \(supported: none, default, linear, llama3, yarn\)",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, r"^rope_scaling type 'yarn' lacks 'factor'$"),
        ({"rope_parameters": {"rope_type": "linear"}}, r"^rope_scaling type 'linear' lacks 'factor'$"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "truncate": "no"}},
            r"^rope_scaling\.truncate must be true or false \(got 'no'\)$",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "attention_factor": -1}},
            r"^rope_scaling\.attention_factor must be a positive finite number \(got -1\.0\)$",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1, "mscale_all_dim": -1}},
            r"^rope_scaling\.mscale_all_dim must be a positive finite number \(got -1\.0\)$",
        ),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
        ({"num_key_value_heads": 3}, r"num_attention_heads must be a multiple of num_key_value_heads"),
        ({"vocab_size": None}, r"config.json lacks 'vocab_size'"),
        ({"sliding_window": -4}, r"sliding_window must be a positive int"),
        # Values of the wrong JSON type are refused by name, never truncated or misread.
        ({"vocab_size": 256.5}, r"^vocab_size must be an integer \(got 256\.5\)$"),
        ({"hidden_size": "64"}, r"^hidden_size must be an integer \(got '64'\)$"),
        ({"num_hidden_layers": True}, r"^num_hidden_layers must be an integer \(got True\)$"),
        ({"rms_norm_eps": "1e-6"}, r"^rms_norm_eps must be a number \(got '1e-6'\)$"),
        ({"tie_word_embeddings": "false"}, r"^tie_word_embeddings must be true or false \(got 'false'\)$"),
        ({"rope_parameters": [1]}, r"^rope_parameters must be a JSON object or null \(got \[1\]\)$"),
        ({"rope_scaling": "x", "rope_parameters": None}, r"^rope_scaling must be a JSON object or null \(got 'x'\)$"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
            r"^rope_parameters\.rope_theta must be a number \(got '1e4'\)$",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": [8],
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "rope_theta": 1e4,
                }
            },
            r"^rope_scaling\.factor must be a number \(got \[8\]\)$",
        ),
        ({"rope_parameters": {"rope_type": ["llama3"], "rope_theta": 1e4}}, r"rope_scaling type \['llama3'\] is not"),
    ],
)
def test_refused_configs(change, message):
    hf = dict(_hf("mistral-window-bf16").to_dict(), **change)
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(rope_attention_factor=1.5),
            r"^LlamaConfig\.rope_attention_factor applies to rope_type 'yarn' only \(got ",
        ),
        (dict(rope_type="yarn", rope_attention_factor=-1.0), r"^LlamaConfig\.rope_attention_factor must be a finite"),
        (dict(rope_type="yarn", rope_truncate=1), r"^LlamaConfig\.rope_truncate must be True or False \(got 1\)$"),
        (dict(rope_type="yarn", rope_beta_fast=0.0), r"^LlamaConfig\.rope_beta_fast must be a positive finite"),
        (dict(rope_type="linear", rope_factor=float("inf")), r"^LlamaConfig\.rope_factor must be a positive finite"),
    ],
)
def test_refused_rope_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**fields)


def test_yarn_attention_factor_defaults_to_yarns_own():
    assert LlamaConfig(rope_type="yarn", rope_factor=4.0).rope_attention_factor == pytest.approx(0.1 * np.log(4) + 1)
    assert LlamaConfig(rope_type="yarn", rope_factor=4.0, rope_attention_factor=0.5).rope_attention_factor == 0.5
    assert LlamaConfig(rope_type="linear", rope_factor=4.0).rope_attention_factor == 1.0


def _weights(config):
    return seeded_weights(config, 3)


def test_bad_weights_name_the_tensor_and_both_shapes():
    config = default_config("llama")
    w = _weights(config)
    missing = dict(w)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lack tensor 'model.layers.1.mlp.up_proj.weight' \(shape \(128, 64\)"):
        weights_from_tensors(config, missing)
    wrong = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.self_attn.k_proj.weight' must have shape "
        r"\(32, 64\) for this config \(got \(64, 64\)\)",
    ):
        weights_from_tensors(config, wrong)
    with pytest.raises(ValueError, match=r"does not use: \['model.layers.0.self_attn.q_proj.bias'\]"):
        weights_from_tensors(config, dict(w, **{"model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)}))
    # Buffers transformers once saved are ignored; a tied lm_head must equal the embedding.
    extra = dict(w, **{"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq(config)})
    assert set(weights_from_tensors(config, extra)) == set(w)
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    tw = _weights(tied)
    same = dict(tw, **{"lm_head.weight": tw["model.embed_tokens.weight"].copy()})
    assert set(weights_from_tensors(tied, same)) == set(tw)
    with pytest.raises(ValueError, match=r"'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        weights_from_tensors(tied, dict(tw, **{"lm_head.weight": tw["model.embed_tokens.weight"] + 1}))


def test_olmo3_layer_types_and_rotary_per_type():
    """OLMo 3 as transformers reads it: without layer_types three sliding layers then a full one,
    a window of 4,096 unless given; old-style rope_scaling for the full layers only; a sliding
    layers' scaling refused by name; two rotary embeddings refused for a model type with one."""
    hf = dict(_hf("olmo3-yarn-window").to_dict(), num_hidden_layers=8)
    for key in ("layer_types", "sliding_window"):
        hf.pop(key)
    c = config_from_hf(hf)
    assert c.layer_windows == (4096, 4096, 4096, 0) * 2 and c.sliding_rope_theta == 500.0
    old = dict(hf, rope_parameters=None, rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    c = config_from_hf(old)
    assert (c.rope_type, c.rope_factor, c.rope_theta, c.sliding_rope_theta) == ("linear", 2.0, 1e4, 1e4)
    plain = config_from_hf(dict(old, rope_scaling=None))
    assert plain.rope_type == "default" and plain.sliding_rope_theta == 0.0  # one rotary embedding
    bad = dict(hf, rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding_attention": _YARN})
    with pytest.raises(ValueError, match=r"^rope_parameters\.sliding_attention type 'yarn' is not supported"):
        config_from_hf(bad)
    gemma = _hf("gemma3-window").to_dict()
    gemma.pop("layer_types")
    assert config_from_hf(dict(gemma, sliding_window_pattern=2)).layer_windows == (5, 0)
    for every in (0, -2):
        with pytest.raises(ValueError, match=rf"^sliding_window_pattern must be a positive int \(got {every}\)$"):
            config_from_hf(dict(gemma, sliding_window_pattern=every))
    smol = _hf("smollm3-nope-window").to_dict()
    with pytest.raises(ValueError, match=r"^no_rope_layers must list 0 or 1 for each of the 2 layers \(got \[1\]\)$"):
        config_from_hf(dict(smol, no_rope_layers=[1]))
    nope = dataclasses.replace(default_config("qwen3"), nope_layers=(0,))
    with pytest.raises(ValueError, match="rotary embeddings in every layer"):
        to_hf(nope, seeded_weights(nope))
    two = dataclasses.replace(default_config("qwen3"), sliding_rope_theta=1e4)
    with pytest.raises(ValueError, match="one rotary embedding for all layers"):
        to_hf(two, seeded_weights(two))


# config.json as published (older key styles: rope_theta, rope_local_base_freq, rope_scaling),
# sizes shrunk; each must read as transformers reads it (its own to_dict, in the newer style).
_PUBLISHED = {
    "gemma-3-1b": dict(
        model_type="gemma3_text", head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000, sliding_window=512,
        sliding_window_pattern=6, num_hidden_layers=13, final_logit_softcapping=None, attn_logit_softcapping=None,
    ),
    "gemma-3-4b-text": dict(
        model_type="gemma3_text", head_dim=256, query_pre_attn_scalar=256, rope_local_base_freq=10000,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, rope_theta=1000000, sliding_window=1024,
        num_hidden_layers=7,
    ),
    "qwen3-yarn": dict(
        model_type="qwen3", head_dim=128, rope_theta=1000000, max_position_embeddings=40960,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "olmo-2": dict(model_type="olmo2", rope_theta=500000, rope_scaling=None, max_position_embeddings=4096),
    "gemma-2-2b": dict(
        model_type="gemma2", head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10000.0,
        num_hidden_layers=4, cache_implementation="hybrid",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(name):
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1)
    raw = {"num_hidden_layers": 2, "max_position_embeddings": 128, **sizes, **_PUBLISHED[name]}
    ours = config_from_hf(raw)
    theirs = transformers.AutoConfig.for_model(**raw)
    assert config_from_hf(theirs.to_dict()) == ours
    types = getattr(theirs, "layer_types", None)
    if ours.layer_windows:
        assert [t == "sliding_attention" for t in types] == [bool(w) for w in ours.layer_windows]
    rotary = transformers.AutoModelForCausalLM.from_config(theirs).model.rotary_emb
    full = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None))
    np.testing.assert_allclose(inv_freq(ours), full, rtol=5e-7)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_keys_left_out_read_as_transformers_defaults_them(model_type):
    """A config.json with the sizes alone: every option it leaves out (norm epsilon, head_dim,
    rotary bases, windows, tied embeddings, ...) as transformers' config class of the type
    assumes it, i.e. the same config as from transformers' own complete to_dict."""
    sizes = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_attention_heads=32, num_hidden_layers=6)
    raw = dict(model_type=model_type, max_position_embeddings=128, **sizes)
    assert config_from_hf(raw) == config_from_hf(transformers.AutoConfig.for_model(**raw).to_dict())


def test_phi3_fused_tensors_split_and_refused_by_name():
    config = default_config("phi3")
    w = _weights(config)
    _, fused = to_hf(config, w)
    qkv, gate_up = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    assert fused[qkv].shape == (128, 64) and fused[gate_up].shape == (256, 64)
    back = weights_from_tensors(config, fused)
    assert set(back) == set(w) and all(np.array_equal(back[k], w[k]) for k in w)  # each part in its place
    assert np.array_equal(back["model.layers.1.self_attn.k_proj.weight"], fused[qkv][64:96])
    assert np.array_equal(back["model.layers.1.mlp.up_proj.weight"], fused[gate_up][128:])
    with pytest.raises(ValueError, match=rf"^weights lack tensor '{qkv}'$"):
        weights_from_tensors(config, {k: v for k, v in fused.items() if k != qkv})
    with pytest.raises(ValueError, match=rf"^tensor '{gate_up}' must have shape \(256, 64\) .*\(got \(255, 64\)\)$"):
        weights_from_tensors(config, dict(fused, **{gate_up: fused[gate_up][:255]}))
    with pytest.raises(ValueError, match=r"phi3 checkpoint holds no projection biases"):
        biased = dataclasses.replace(config, qkv_bias=True)
        to_hf(biased, _weights(biased))


def test_checkpoint_with_a_wrong_shape_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from trace_replay_app.checkpoint import CheckpointError, load_checkpoint

    folder = make_checkpoint("qwen3", str(tmp_path / "m"))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.k_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, path)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.1.self_attn.k_norm.weight' "
        r"must have shape \(32,\) for this config \(got \(16,\)\)",
    ):
        load_checkpoint(folder)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"lack tensor 'model.layers.1.self_attn.k_norm.weight'"):
        load_checkpoint(folder)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_default_configs_round_trip_and_run_in_transformers(model_type, rng):
    """The seeded default model of each type, written as transformers' config + weights, gives
    transformers' logits: the ``--model NAME --seed N`` path is the real model."""
    from trace_replay_app.models.llama.torch_loop import run_decode
    from trace_replay_app.records import TraceRequest

    config = default_config(model_type)
    weights = seeded_weights(config, 5)
    check_weights(config, weights)
    assert all(np.array_equal(weights[k], v) for k, v in seeded_weights(config, 5).items())
    hf, tensors = to_hf(config, weights)
    assert config_from_hf(json.loads(json.dumps(hf))) == config
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    missing = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}
    prompt = tuple(int(t) for t in rng.integers(0, config.vocab_size, 40))
    trace = tuple(int(t) for t in rng.integers(0, config.vocab_size, 12))
    (res,) = run_decode(config, weights, [TraceRequest("a", prompt=prompt, trace=trace)])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + trace[:-1]])).logits[0, len(prompt) - 1 :].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(trace)), torch.tensor(trace)].numpy()
    np.testing.assert_allclose(res.logprobs, want, atol=1e-5)


def test_registry_entries():
    for t in MODEL_TYPES:
        assert t in supported_model_types()
    assert family_for_model_type("mistral") is get_family("llama")
    families = {t: family_for_model_type(t) for t in MODEL_TYPES}
    assert set(MODEL_TYPES) - {"mistral"} == {f.model_types[0] for f in families.values()}  # one entry each
    for family in families.values():
        config = family.default_config()
        assert isinstance(config, LlamaConfig) and config.model_type == family.model_types[0]
        assert get_family(family.name) is family
        family.check_weights(config, family.seeded_weights(config, 0))
