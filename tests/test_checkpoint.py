"""Checkpoints: safetensors files through the ``safetensors`` package, Hugging Face GPT-2 folders
(one file or a sharded set), loaded in both frameworks; bad folders refused naming the file."""

import json
import os
import re
import struct

import numpy as np
import pytest
from helpers.cli_helpers import (
    SMALL_GPT2,
    checkpoint_without_shard,
    edit_config,
    file_of_bytes,
    good_safetensors_bytes,
    index_naming_absent_tensor,
    raw_safetensors,
    relabelled_checkpoint,
    rewrite_weights,
    sharded_checkpoint,
    small_checkpoint,
    store_as_f64,
    truncate,
)

from trace_replay_app.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_safetensors,
    save_checkpoint,
    write_safetensors,
)
from trace_replay_app.models import get_family
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights


def _load(path):
    with open(path) as f:
        return json.load(f)


def _config_with_literal(d, family, key, literal):
    """A checkpoint folder's config.json of ``family``'s default config with ``key`` written as
    the JSON text ``literal`` (``1e400`` reads as inf); no weights (the config is read first)."""
    fam = get_family(family)
    hf, _ = fam.to_hf(fam.default_config(), fam.seeded_weights(fam.default_config(), 0))
    return file_of_bytes(d / "config.json", json.dumps(dict(hf, **{key: "@"})).replace('"@"', literal).encode(), d)


def _bf16(x):
    """float32 rounded to bfloat16 and back, through torch (an independent reference)."""
    import torch

    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("dtype, np_dtype", [("F32", np.float32), ("F16", np.float16), ("F64", np.float64)])
def test_safetensors_round_trip(tmp_path, dtype, np_dtype):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b.c": np.float32(2.5) * np.ones(7, np.float32),
        "scalar": np.array(-1.25, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors, dtype=dtype, metadata={"format": "pt"})
    got, meta = read_safetensors(path)
    assert meta == {"format": "pt"} and sorted(got) == sorted(tensors)  # the package orders the file itself
    for name, value in tensors.items():
        assert got[name].dtype == np.float32 and got[name].shape == value.shape
        np.testing.assert_array_equal(got[name], value.astype(np_dtype).astype(np.float32))
    # the layout itself: u64 header length, 8-byte aligned JSON header, offsets in order
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and header["a"]["dtype"] == dtype and header["a"]["shape"] == [3, 5]
    begin, end = header["a"]["data_offsets"]
    assert end - begin == 15 * np.dtype(np_dtype).itemsize


def test_bf16_rounds_to_nearest_even_and_widens_exactly(tmp_path):
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            rng.standard_normal(1000).astype(np.float32) * 10,
            np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, np.inf, -np.inf, 3.4e38, 1e-40], np.float32),
        ]
    )
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, {"x": x}, dtype="BF16")
    got = read_safetensors(path)[0]["x"]
    np.testing.assert_array_equal(got, _bf16(x))
    # widening is exact: a bf16 value survives a second round trip unchanged
    write_safetensors(path, {"x": got}, dtype="BF16")
    np.testing.assert_array_equal(read_safetensors(path)[0]["x"], got)
    write_safetensors(path, {"x": np.array([np.nan], np.float32)}, dtype="BF16")
    assert np.isnan(read_safetensors(path)[0]["x"]).all()


def test_read_only_some_names(tmp_path):
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
    assert list(read_safetensors(path, names={"b"})[0]) == ["b"]


# The package's own words for a malformed file vary between its versions: the file is named, the
# problem is "not a readable safetensors file (<the package's reason>)".
_UNREADABLE = r"not a readable safetensors file \(.+\)$"
BAD_FILES = {
    "too_short": (lambda p: file_of_bytes(p, b"\x01\x02"), _UNREADABLE),
    "header_too_long": (lambda p: raw_safetensors(p, {}, length=10_000), _UNREADABLE),
    "header_not_json": (lambda p: file_of_bytes(p, struct.pack("<Q", 3) + b"{x}"), _UNREADABLE),
    "header_not_object": (lambda p: raw_safetensors(p, [1]), _UNREADABLE),
    "dtype": (
        lambda p: raw_safetensors(p, {"t": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
        r"tensor 't': dtype 'I64' is not supported \(supported: F32, F16, BF16, F64\)",
    ),
    "shape": (
        lambda p: raw_safetensors(p, {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        _UNREADABLE,
    ),
    "offsets_outside": (
        lambda p: raw_safetensors(p, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        _UNREADABLE,
    ),
    "offsets_vs_shape": (
        lambda p: raw_safetensors(p, {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        _UNREADABLE,
    ),
    "missing_offsets": (lambda p: raw_safetensors(p, {"t": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), _UNREADABLE),
    "truncated": (lambda p: file_of_bytes(p, good_safetensors_bytes()[:-6]), _UNREADABLE),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_safetensors_files(tmp_path, case):
    make, pattern = BAD_FILES[case]
    path = make(tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="^" + re.escape(path) + ": " + pattern):
        read_safetensors(path)


@pytest.mark.parametrize(
    "dtype, prefix, extras", [("F32", "", False), ("BF16", "transformer.", True), ("F16", "transformer.", False)]
)
def test_checkpoint_round_trip(tmp_path, dtype, prefix, extras):
    weights = seeded_weights(SMALL_GPT2, 5)
    save_checkpoint(
        str(tmp_path), SMALL_GPT2, weights, dtype=dtype, prefix=prefix, tied_lm_head=extras, mask_buffers=extras
    )
    family, config, loaded = load_checkpoint(str(tmp_path))
    assert config == SMALL_GPT2 and set(loaded) == set(weights)
    for name, w in weights.items():
        expected = _bf16(w) if dtype == "BF16" else w.astype(np.float16).astype(np.float32) if dtype == "F16" else w
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], expected, err_msg=name)
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert any(k.startswith("transformer.") for k in header) == bool(prefix)


BAD_CHECKPOINTS = {
    "not_a_folder": (lambda d: str(d / "nope"), r"nope: not a folder"),
    "no_config": (lambda d: file_of_bytes(d / "model.safetensors", b"", d), r"config\.json: missing$"),
    "config_lacks": (
        lambda d: file_of_bytes(d / "config.json", b'{"vocab_size": 5}', d),
        r"config\.json: config\.json lacks n_positions, n_embd, n_layer, n_head$",
    ),
    "activation": (
        lambda d: edit_config(small_checkpoint(d), activation_function="relu") or str(d),
        r"config\.json: activation_function='relu' is not supported",
    ),
    "no_weights": (
        lambda d: file_of_bytes(d / "config.json", json.dumps(SMALL_GPT2.to_hf()).encode(), d),
        r"model\.safetensors: missing \(and no model\.safetensors\.index\.json of a sharded checkpoint\)$",
    ),
    "empty_index": (
        lambda d: file_of_bytes(
            d / "model.safetensors.index.json",
            b"{}",
            file_of_bytes(d / "config.json", json.dumps(SMALL_GPT2.to_hf()).encode(), d),
        ),
        r"model\.safetensors\.index\.json: must hold a non-empty \"weight_map\"",
    ),
    "missing_tensor": (
        lambda d: rewrite_weights(small_checkpoint(d), lambda t: t.pop("h.1.mlp.c_fc.bias")) or str(d),
        r"model\.safetensors: weights lack parameter 'h\.1\.mlp\.c_fc\.bias'",
    ),
    "wrong_shape": (
        lambda d: rewrite_weights(small_checkpoint(d), lambda t: t.update({"wpe.weight": np.zeros((4, 16))})) or str(d),
        r"model\.safetensors: weights\['wpe\.weight'\] must have shape \(40, 16\)",
    ),
    "untied_lm_head": (
        lambda d: (
            rewrite_weights(small_checkpoint(d), lambda t: t.update({"lm_head.weight": t["wte.weight"] + 1})) or str(d)
        ),
        r"model\.safetensors: tensor 'lm_head\.weight' differs from 'wte\.weight'",
    ),
    "twice": (
        lambda d: (
            rewrite_weights(small_checkpoint(d), lambda t: t.update({"transformer.ln_f.bias": t["ln_f.bias"]}))
            or str(d)
        ),
        r"tensor 'ln_f\.bias' appears twice",
    ),
    "unexpected": (
        lambda d: rewrite_weights(small_checkpoint(d), lambda t: t.update({"h.9.ln_1.weight": np.ones(16)})) or str(d),
        r"weights hold unexpected parameters \['h\.9\.ln_1\.weight'\]",
    ),
    "config_not_utf8": (
        lambda d: file_of_bytes(d / "config.json", b'{"model_type": "gpt\xff"}', d),
        r"config\.json: cannot read \('utf-8' codec can't decode byte 0xff",
    ),
    "config_nested_deeply": (
        lambda d: file_of_bytes(d / "config.json", b"[" * 100_000 + b"]" * 100_000, d),
        r"config\.json: cannot read \(JSON nested too deeply\)$",
    ),
    "config_integer_too_long": (
        lambda d: file_of_bytes(d / "config.json", b'{"vocab_size": ' + b"7" * 5000 + b"}", d),
        r"config\.json: cannot read \(Exceeds the limit \(4300 digits\)",
    ),
    "config_nan": (
        lambda d: file_of_bytes(d / "config.json", b'{"model_type": "gpt2", "layer_norm_epsilon": NaN}', d),
        r"config\.json: cannot read \(NaN is not a JSON value\)$",
    ),
    "nan_weight": (
        lambda d: (
            rewrite_weights(small_checkpoint(d), lambda t: t["h.1.attn.c_attn.weight"].__setitem__((3, 7), np.nan))
            or str(d)
        ),
        r"model\.safetensors: tensor 'h\.1\.attn\.c_attn\.weight': value nan at index \[3, 7\] is not finite$",
    ),
    "infinite_bias": (
        lambda d: (
            rewrite_weights(small_checkpoint(d), lambda t: t["ln_f.bias"].__setitem__(slice(4, None), -np.inf))
            or str(d)
        ),
        r"model\.safetensors: tensor 'ln_f\.bias': value -inf at index \[4\] is not finite$",
    ),
    "f64_beyond_float32": (
        lambda d: store_as_f64(small_checkpoint(d), "wpe.weight", (0, 2), 1e300) or str(d),
        r"model\.safetensors: tensor 'wpe\.weight': value 1e\+300 at index \[0, 2\] is beyond float32's range$",
    ),
    "epsilon_not_a_number": (
        lambda d: edit_config(small_checkpoint(d), layer_norm_epsilon="1e-5") or str(d),
        r"config\.json: layer_norm_epsilon must be a number \(got '1e-5'\)$",
    ),
    "epsilon_overflows": (
        lambda d: _config_with_literal(d, "gpt2", "layer_norm_epsilon", "1e400"),  # 1e400 reads as inf
        r"config\.json: layer_norm_epsilon must be a finite number \(got inf\)$",
    ),
    "rms_norm_eps_overflows": (
        lambda d: _config_with_literal(d, "llama", "rms_norm_eps", "-1e999"),
        r"config\.json: rms_norm_eps must be a finite number \(got -inf\)$",
    ),
}


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -1e-5])
def test_gpt2_config_refuses_an_epsilon_not_positive_and_finite(eps):
    with pytest.raises(ValueError, match=r"^GPT2Config\.layer_norm_epsilon must be a positive finite float"):
        GPT2Config(layer_norm_epsilon=eps)


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints(tmp_path, case):
    make, pattern = BAD_CHECKPOINTS[case]
    folder = make(tmp_path)
    with pytest.raises(CheckpointError, match="^" + re.escape(str(tmp_path)) + ".*" + pattern):
        load_checkpoint(folder)


def test_checkpoint_runs_the_same_in_both_frameworks(tmp_path, capsys):
    """A bf16 checkpoint with the transformer. prefix, mask buffers and a tied head, replayed by
    `run` in torch and in JAX: the config comes from the folder, every trace is reproduced, and
    the two frameworks agree; an F32 checkpoint of seeded weights runs like the seeded model."""
    from trace_replay_app import cli
    from trace_replay_app.traces import random_requests, write_traces

    folder = tmp_path / "ckpt"
    save_checkpoint(
        str(folder),
        SMALL_GPT2,
        seeded_weights(SMALL_GPT2, 2),
        dtype="BF16",
        prefix="transformer.",
        tied_lm_head=True,
        mask_buffers=True,
    )
    traces = str(tmp_path / "t.jsonl")
    write_traces(traces, random_requests(SMALL_GPT2, 10, seed=4, prompt_len=(1, 12), new_tokens=(1, 12)))
    outs = {}
    for fw in ("torch", "jax"):
        out = str(tmp_path / f"{fw}.json")
        assert (
            cli.main(
                [
                    "run",
                    "--framework",
                    fw,
                    "--traces",
                    traces,
                    "--checkpoint",
                    str(folder),
                    "--out",
                    out,
                    "--max-batch",
                    "4",
                    "--quiet",
                ]
            )
            == 0
        ), capsys.readouterr().err
        outs[fw] = _load(out)
    for doc in outs.values():
        s = doc["summary"]
        assert s["model"]["vocab_size"] == 96 and s["weights"] == {"source": "checkpoint", "checkpoint": str(folder)}
        assert s["exact_reproductions"] == s["traced_requests"] == 10
    for a, b in zip(outs["torch"]["requests"], outs["jax"]["requests"], strict=True):
        assert a["id"] == b["id"] and a["tokens"] == b["tokens"] and a["ranks"] == b["ranks"]
        assert a["argmax"] == b["argmax"]
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)

    # the seeded tiny model saved as an F32 checkpoint runs exactly like --seed
    config = GPT2Config()
    save_checkpoint(str(tmp_path / "seeded"), config, seeded_weights(config, 0))
    write_traces(traces, random_requests(config, 6, seed=5, traced=0.5))
    docs = []
    for source in (["--checkpoint", str(tmp_path / "seeded")], ["--seed", "0"]):
        out = str(tmp_path / "torch.json")
        assert cli.main(["run", "--framework", "torch", "--traces", traces, "--out", out, "--quiet", *source]) == 0
        docs.append(_load(out)["requests"])
    assert docs[0] == docs[1]


# sharded sets, model_type, refusals through the command line --------------------------------------
def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    """An index and 2 shards (the Hugging Face layout) load to the same weights as one file."""
    weights = seeded_weights(SMALL_GPT2, 7)
    save_checkpoint(str(tmp_path / "one"), SMALL_GPT2, weights, prefix="transformer.")
    save_checkpoint(str(tmp_path / "two"), SMALL_GPT2, weights, prefix="transformer.", shards=2)
    index = _load(tmp_path / "two" / "model.safetensors.index.json")
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert not (tmp_path / "two" / "model.safetensors").exists()
    family, config, one = load_checkpoint(str(tmp_path / "one"))
    family2, config2, two = load_checkpoint(str(tmp_path / "two"))
    assert family is family2 and family.name == "gpt2" and config == config2 == SMALL_GPT2
    assert sorted(one) == sorted(two) == sorted(weights)
    for name in weights:
        np.testing.assert_array_equal(two[name], weights[name], err_msg=name)


REFUSED = {
    "unsupported_model_type": (
        lambda d: relabelled_checkpoint(d, "bert"),
        r"config\.json: model_type 'bert' is not supported \(supported: gpt2(, \w+)*\)$",
    ),
    "missing_shard": (
        checkpoint_without_shard,
        r"model-00002-of-00002\.safetensors: missing \(the shard "
        r"model\.safetensors\.index\.json names for tensor '.+'\)$",
    ),
    "truncated_file": (
        lambda d: truncate(d / "model.safetensors") or str(d) if small_checkpoint(d) else None,
        r"model\.safetensors: not a readable safetensors file \(.+\)$",
    ),
    "truncated_shard": (
        lambda d: truncate(d / "model-00001-of-00002.safetensors") or str(d) if sharded_checkpoint(d) else None,
        r"model-00001-of-00002\.safetensors: not a readable safetensors file \(.+\)$",
    ),
    "tensor_not_in_its_shard": (
        index_naming_absent_tensor,
        r"model-00002-of-00002\.safetensors: tensor 'h\.0\.ln_1\.weight' missing \(named by "
        r"model\.safetensors\.index\.json\)$",
    ),
    "wrong_shape": (
        lambda d: rewrite_weights(small_checkpoint(d), lambda t: t.update({"ln_f.bias": np.zeros(17)})) or str(d),
        r"model\.safetensors: weights\['ln_f\.bias'\] must have shape \(16,\) \(got \(17,\)\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_checkpoints_exit_2_and_write_nothing(tmp_path, case, capsys):
    """Each bad folder: exit status 2, one line naming the file (and tensor), no output file."""
    from trace_replay_app import cli
    from trace_replay_app.traces import random_requests, write_traces

    make, pattern = REFUSED[case]
    folder = make(tmp_path / "ckpt")
    work = tmp_path / "work"
    work.mkdir()
    traces = str(work / "t.jsonl")
    write_traces(traces, random_requests(SMALL_GPT2, 3, seed=1))
    before = {p: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    for args in (
        ["run", "--framework", "torch", "--out", str(work / "o.json")],
        ["compare", "--out-dir", str(work / "cmp")],
    ):
        status = cli.main([*args, "--traces", traces, "--checkpoint", folder, "--quiet"])
        err = capsys.readouterr().err
        assert status == 2, err
        assert re.match(rf"^trace-replay {args[0]}: error: {re.escape(folder)}/{pattern}", err.strip()), err
        assert len(err.strip().splitlines()) == 1
        assert sorted(os.listdir(work)) == ["t.jsonl"]
    assert {p: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before  # inputs untouched
