"""GPT-2 checkpoints in the Hugging Face layout: ``config.json`` + ``model.safetensors``.

A small safetensors reader and writer in numpy. The format: 8 bytes of little-endian
unsigned header length ``N``; ``N`` bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows the
header), plus an optional ``"__metadata__"`` mapping of strings; then the raw little-endian
tensor data. Supported dtypes: F32, F16, BF16 and F64, all returned as float32 (bfloat16 is
the high half of a float32, so it widens exactly).

:func:`load_checkpoint` maps a Hugging Face ``GPT2LMHeadModel`` checkpoint to this project's
parameter names (:mod:`trace_replay_core.app.model`): an optional ``transformer.`` prefix is
dropped, the causal-mask buffers ``h.N.attn.bias`` / ``h.N.attn.masked_bias`` are ignored,
and ``lm_head.weight`` is accepted only when it equals ``wte.weight`` (tied, as in GPT-2).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from .model import GPT2Config, check_weights, param_shapes
from .traces import atomic_write

__all__ = ["CheckpointError", "read_safetensors", "write_safetensors", "load_checkpoint", "save_checkpoint",
           "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
_MAX_HEADER = 100 << 20   # a header larger than 100 MiB is a corrupt file, not a checkpoint
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint folder or safetensors file that cannot be used; the message names the file
    and, where there is one, the tensor."""


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Little-endian stored values -> native float32."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def read_safetensors(path: str, names: Optional[set] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """``(tensors, metadata)`` of the safetensors file ``path``: every tensor (or only those in
    ``names``) as a new native float32 array, and the ``__metadata__`` mapping (empty if none).

    Raises :class:`CheckpointError` naming the file (and tensor) for a truncated or malformed
    header, offsets outside the data or not matching the shape, or an unsupported dtype of a
    tensor that is read.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: header must be a JSON object")
            metadata = header.pop("__metadata__", None) or {}
            if not isinstance(metadata, dict):
                raise CheckpointError(f"{path}: __metadata__ must be a JSON object")
            data_size = size - 8 - n
            tensors = {}
            for name, info in header.items():
                if names is not None and name not in names:
                    continue
                raw_dtype, shape, begin, end = _entry(path, name, info, data_size)
                f.seek(8 + n + begin)
                buf = f.read(end - begin)
                raw = np.frombuffer(buf, dtype=_DTYPES[raw_dtype]).reshape(shape)
                tensors[name] = _widen(raw, raw_dtype)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return tensors, metadata


def _entry(path: str, name: str, info, data_size: int):
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: header entry must be an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r}: dtype {dtype!r} is not supported "
                              f"(supported: {', '.join(_DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: shape must be a list of non-negative ints (got {shape!r})")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] (got {offsets!r})")
    begin, end = offsets
    expected = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data_size:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets} lie outside the "
                              f"{data_size} bytes of data")
    if end - begin != expected:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes, "
                              f"shape {shape} in {dtype} needs {expected}")
    return dtype, tuple(shape), begin, end


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], *, dtype: str = "F32",
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` (float arrays, converted) to ``path`` as safetensors in ``dtype`` (F32,
    F16, BF16 with round-to-nearest-even, or F64), in the order given, atomically."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (got {dtype!r})")
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name, value in tensors.items():
        arr = np.asarray(value)
        data = _to_bf16_bits(arr) if dtype == "BF16" else np.ascontiguousarray(arr, dtype=_DTYPES[dtype])
        blob = data.astype(_DTYPES[dtype].newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)          # the format pads the header to 8 bytes with spaces
    with atomic_write(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load_checkpoint(folder: str) -> Tuple[GPT2Config, Dict[str, np.ndarray]]:
    """``(config, weights)`` of the Hugging Face GPT-2 checkpoint in ``folder``
    (``config.json`` + ``model.safetensors``); weights are float32 numpy arrays under this
    project's names, checked against the config. Raises :class:`CheckpointError`."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder holding {CONFIG_FILE} "
                              f"and {WEIGHTS_FILE})")
    config_path, weights_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: cannot read ({exc})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path}: must hold a JSON object")
    try:
        config = GPT2Config.from_hf(hf)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    for key, supported in (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                           ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                           ("tie_word_embeddings", True)):
        if key in hf and hf[key] != supported:
            raise CheckpointError(f"{config_path}: {key}={hf[key]!r} is not supported (the reference loops "
                                  f"implement GPT-2 with {key}={supported!r})")
    if not os.path.isfile(weights_path):
        hint = (" (sharded checkpoints are not supported: merge the shards into one file)"
                if os.path.exists(weights_path + ".index.json") else "")
        raise CheckpointError(f"{weights_path}: missing{hint}")
    raw, _ = read_safetensors(weights_path, names=_wanted(weights_path, config))
    weights: Dict[str, np.ndarray] = {}
    lm_head = None
    for name, value in raw.items():
        short = name.removeprefix("transformer.")
        if short == "lm_head.weight":
            lm_head = value
        elif short in weights:
            raise CheckpointError(f"{weights_path}: tensor {short!r} appears twice (with and without the "
                                  "'transformer.' prefix)")
        else:
            weights[short] = value
    try:
        check_weights(config, weights)
    except ValueError as exc:
        raise CheckpointError(f"{weights_path}: {exc}") from None
    if lm_head is not None and not np.array_equal(lm_head, weights["wte.weight"]):
        raise CheckpointError(f"{weights_path}: tensor 'lm_head.weight' differs from 'wte.weight' (the "
                              "reference loops tie the output projection to the token embedding)")
    return config, weights


def _wanted(path: str, config: GPT2Config) -> set:
    """The tensor names to read: all but the ignored attention-mask buffers (read only the
    header here; unknown names are read so that check_weights can name them)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = json.loads(f.read(min(n, _MAX_HEADER)).decode("utf-8")) if 0 < n else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, struct.error):
        return None  # let read_safetensors report the problem
    if not isinstance(header, dict):
        return None
    keep = set()
    for name in header:
        if name == "__metadata__":
            continue
        short = name.removeprefix("transformer.")
        if short.startswith("h.") and short.endswith(_IGNORED_SUFFIXES) and short not in param_shapes(config):
            continue
        keep.add(name)
    return keep


def save_checkpoint(folder: str, config: GPT2Config, weights: Mapping[str, np.ndarray], *, dtype: str = "F32",
                    prefix: str = "", tied_lm_head: bool = False, mask_buffers: bool = False) -> None:
    """Write ``config.json`` and ``model.safetensors`` for ``weights`` into ``folder`` (created
    if needed), in ``dtype``, with every name prefixed by ``prefix`` (e.g. ``"transformer."``),
    optionally with a tied ``lm_head.weight`` and the causal-mask buffers Hugging Face stores."""
    check_weights(config, weights)
    os.makedirs(folder, exist_ok=True)
    tensors = {prefix + name: np.asarray(weights[name]) for name in param_shapes(config)}
    if mask_buffers:
        n = config.n_positions
        for i in range(config.n_layer):
            tensors[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((n, n), np.float32))[None, None]
            tensors[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if tied_lm_head:
        tensors["lm_head.weight"] = np.asarray(weights["wte.weight"])
    write_safetensors(os.path.join(folder, WEIGHTS_FILE), tensors, dtype=dtype, metadata={"format": "pt"})
    with atomic_write(os.path.join(folder, CONFIG_FILE)) as f:
        json.dump(config.to_hf(), f, indent=1)
        f.write("\n")
