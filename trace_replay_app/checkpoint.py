"""Hugging Face checkpoint folders, read with the ``safetensors`` package's numpy API.

A checkpoint is a folder with ``config.json`` and either one ``model.safetensors`` or a sharded
set: ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``) and the
shard files it names. ``config.json``'s ``model_type`` picks the family from the registry
(:mod:`trace_replay_app.models`); any other is refused, naming it and the supported ones. The
family maps the tensors to its loops' names and checks them against the config.

Weights may be stored as F32, F16, BF16 or F64; they are returned as float32 numpy arrays
(bfloat16 is the high half of a float32, so it widens exactly; it is read through ``ml_dtypes``,
which registers numpy's ``bfloat16``). Framework-neutral: no torch, no JAX.

Every problem raises :class:`CheckpointError` naming the file and, where there is one, the
tensor: a truncated or malformed file, an index naming a missing shard, a tensor the index
names but its shard lacks, a missing or mis-shaped tensor (both shapes), a NaN or infinite
weight (or one beyond float32's range: the first such index and its value). Files are only read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes  # noqa: F401 - registers numpy's bfloat16, which safetensors' numpy API returns for BF16
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as _save_bytes

from .models import Family, family_for_config, family_for_model_type
from .traces import atomic_write

__all__ = [
    "CheckpointError",
    "read_safetensors",
    "write_safetensors",
    "read_config",
    "read_tensors",
    "load_checkpoint",
    "save_checkpoint",
    "checkpoint_inputs",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "INDEX_FILE",
    "STORED_DTYPES",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}


class CheckpointError(ValueError):
    """A checkpoint folder or safetensors file that cannot be used; the message names the file
    and, where there is one, the tensor."""


def _message(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def _finite(path: str, name: str, stored: np.ndarray, widened: np.ndarray) -> np.ndarray:
    """``widened`` (float32) if every value is finite, else :class:`CheckpointError` naming the
    tensor, the first bad index and its stored value (NaN, infinite, or beyond float32)."""
    bad = ~np.isfinite(widened)
    if bad.any():
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), widened.shape))
        value = float(np.asarray(stored, dtype=np.float64)[index])
        what = "beyond float32's range" if math.isfinite(value) else "not finite"
        raise CheckpointError(f"{path}: tensor {name!r}: value {value!r} at index {list(index)} is {what}")
    return widened


def read_safetensors(
    path: str, names: set | None = None, *, finite: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of the safetensors file ``path``: every tensor (or only those in
    ``names``) as a new native float32 array, and the ``__metadata__`` mapping (empty if none).

    Raises :class:`CheckpointError` naming the file (and tensor) for a truncated or malformed
    file, a tensor of a dtype other than F32, F16, BF16 or F64, and with ``finite`` a tensor
    holding a NaN or infinite value (or one beyond float32's range), naming the first such index
    and its value. Host-only, reads the file.
    """
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(path, framework="np") as f:
            metadata = dict(f.metadata() or {})
            for name in f.keys():
                if names is not None and name not in names:
                    continue
                dtype = f.get_slice(name).get_dtype()
                if dtype not in STORED_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {name!r}: dtype {dtype!r} is not supported "
                        f"(supported: {', '.join(STORED_DTYPES)})"
                    )
                try:
                    stored = np.asarray(f.get_tensor(name))
                    with np.errstate(over="ignore"):  # F64 beyond float32 becomes inf: refused with finite
                        widened = stored.astype(np.float32)
                except (SafetensorError, ValueError, TypeError, OSError) as exc:
                    raise CheckpointError(f"{path}: tensor {name!r}: cannot read ({_message(exc)})") from None
                tensors[name] = _finite(path, name, stored, widened) if finite else widened
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: not a readable safetensors file ({_message(exc)})") from None
    return tensors, metadata


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], *, dtype: str = "F32", metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (float arrays, converted; BF16 rounds to nearest even) to ``path`` as
    safetensors in ``dtype`` (F32, F16, BF16 or F64), atomically."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(STORED_DTYPES)} (got {dtype!r})")
    # np.array copies C-contiguous and keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    arrays = {
        name: np.array(value, dtype=np.float32).astype(STORED_DTYPES[dtype], order="C")
        for name, value in tensors.items()
    }
    data = _save_bytes(arrays, metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
    with atomic_write(path, "wb") as f:
        f.write(data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, parse_constant=_no_constant)  # NaN / Infinity: Python's extension
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read (JSON nested too deeply)") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, an over-long integer
        raise CheckpointError(f"{path}: cannot read ({exc})") from None


def read_config(folder: str) -> tuple[Family, Any]:
    """``(family, config)`` of the checkpoint folder's ``config.json``: the family serving its
    ``model_type``, and that family's config of it. Raises :class:`CheckpointError`."""
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"{folder}: not a folder (a checkpoint is a folder holding {CONFIG_FILE} "
            f"and {WEIGHTS_FILE} or {INDEX_FILE} with its shards)"
        )
    path = os.path.join(folder, CONFIG_FILE)
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    model_type = hf.get("model_type", "gpt2")  # GPT-2 configs written before model_type existed lack it
    try:
        family = family_for_model_type(model_type)
        return family, family.config_from_hf(hf)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _shards(folder: str) -> tuple[str, dict[str, list[str] | None]]:
    """``(where, {shard path: [tensor names] or None for all})``: the one weights file, or the
    index's shards (``where`` is the file that errors about the whole set name)."""
    single, index = os.path.join(folder, WEIGHTS_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return single, {single: None}
    if not os.path.exists(index):
        raise CheckpointError(f"{single}: missing (and no {INDEX_FILE} of a sharded checkpoint)")
    doc = _read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise CheckpointError(f'{index}: must hold a non-empty "weight_map" of tensor name -> shard file')
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: tensor {name!r}: shard {shard!r} must be a file name in the folder")
        path = os.path.join(folder, shard)
        if path not in shards and not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the shard {INDEX_FILE} names for tensor {name!r})")
        shards.setdefault(path, []).append(name)
    return index, {path: names for path, names in shards.items()}


def read_tensors(folder: str) -> tuple[str, dict[str, np.ndarray]]:
    """``(where, tensors)``: every tensor of the folder's weights (one file or every shard of
    the index) as float32 arrays, and the file naming the set. Raises :class:`CheckpointError`
    naming the file for a truncated shard, a missing shard, a tensor the index places in a
    shard that lacks it, or a weight that is not finite (the tensor and the first bad index)."""
    where, shards = _shards(folder)
    tensors: dict[str, np.ndarray] = {}
    for path, names in shards.items():
        got, _ = read_safetensors(path, names=None if names is None else set(names), finite=True)
        for name in names or ():
            if name not in got:
                raise CheckpointError(f"{path}: tensor {name!r} missing (named by {INDEX_FILE})")
        for name, value in got.items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} appears in two shards")
            tensors[name] = value
    return where, tensors


def checkpoint_inputs(folder: str | None) -> list[str]:
    """The files of the checkpoint ``folder`` that loading it reads and that exist (config,
    weights, index and every ``*.safetensors`` shard): outputs must not replace them."""
    if folder is None or not os.path.isdir(folder):
        return []
    names = sorted(n for n in os.listdir(folder) if n in (CONFIG_FILE, INDEX_FILE) or n.endswith(".safetensors"))
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def load_checkpoint(folder: str) -> tuple[Family, Any, dict[str, np.ndarray]]:
    """``(family, config, weights)`` of the Hugging Face checkpoint in ``folder``: weights are
    float32 numpy arrays under the family's names, checked against the config. Host-only,
    reads the files; raises :class:`CheckpointError`."""
    family, config = read_config(folder)
    where, tensors = read_tensors(folder)
    try:
        weights = family.weights_from_tensors(config, tensors)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return family, config, weights


def save_checkpoint(
    folder: str, config: Any, weights: Mapping[str, np.ndarray], *, dtype: str = "F32", shards: int = 1, **options: Any
) -> None:
    """Write ``config.json`` and the weights of ``config``'s family into ``folder`` (created if
    needed) in ``dtype``: one ``model.safetensors``, or with ``shards`` > 1 that many files and
    ``model.safetensors.index.json``. ``options`` go to the family's ``to_hf`` (GPT-2:
    ``prefix``, ``tied_lm_head``, ``mask_buffers``). For tests and benchmarks."""
    family = family_for_config(config)
    if family.to_hf is None:
        raise ValueError(f"the {family.name} family cannot write checkpoints (it has no to_hf)")
    hf, tensors = family.to_hf(config, weights, **options)
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(folder, WEIGHTS_FILE), tensors, dtype=dtype, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(
                os.path.join(folder, file),
                {names[j]: tensors[names[j]] for j in part},
                dtype=dtype,
                metadata={"format": "pt"},
            )
            weight_map.update({names[j]: file for j in part})
        with atomic_write(os.path.join(folder, INDEX_FILE)) as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with atomic_write(os.path.join(folder, CONFIG_FILE)) as f:
        json.dump(hf, f, indent=1)
        f.write("\n")
