"""Typed reads of a Hugging Face ``config.json`` mapping, shared by the families' config readers.

A checkpoint is untrusted input: a value of the wrong JSON type is refused with a
``ValueError`` that names the key and the value, never truncated (``256.5`` as ``256``) or
misread (the string ``"false"`` as true).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["get", "get_int", "get_float", "get_bool", "get_mapping"]


def get(hf: Mapping[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    """``hf[key]``, or ``default`` where it is missing or null; ``required`` refuses a missing one."""
    value = hf.get(key, default)
    if value is None and required:
        raise ValueError(f"config.json lacks {key!r}")
    return default if value is None else value


def get_int(hf: Mapping[str, Any], key: str, default: Any = None, required: bool = False, *, name: str = "") -> int:
    """``hf[key]`` (or ``default``) as an int; a float, string, bool or other type is refused,
    naming the key (``name`` when the key sits inside another mapping)."""
    value = get(hf, key, default, required)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name or key} must be an integer (got {value!r})")
    return value


def get_float(hf: Mapping[str, Any], key: str, default: Any = None, required: bool = False, *, name: str = "") -> float:
    """``hf[key]`` (or ``default``) as a finite float; only JSON numbers are accepted, naming
    the key (a literal beyond float's range, ``1e400``, reads as infinite and is refused)."""
    value = get(hf, key, default, required)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name or key} must be a number (got {value!r})")
    try:
        number = float(value)
    except OverflowError:  # an integer literal beyond float's range
        number = math.copysign(math.inf, value)
    if not math.isfinite(number):
        raise ValueError(f"{name or key} must be a finite number (got {number!r})")
    return number


def get_bool(hf: Mapping[str, Any], key: str) -> bool:
    """``hf[key]`` as a bool (missing or null: False); only JSON true/false, naming the key."""
    value = hf.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false (got {value!r})")
    return value


def get_mapping(hf: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``hf[key]`` as a dict (missing or null: empty), else ``ValueError`` naming the key."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object or null (got {value!r})")
    return dict(value)
