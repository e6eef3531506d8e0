"""The value checks every rollout format shares, and the records its parsers return (numpy-free).

Each check takes a decoded JSON value and the name of the field it came from (a dotted path such
as ``choices[1].logprobs.tokens``) and returns the value, or raises :class:`Invalid` naming that
field. Token ids are non-negative integers up to :data:`MAX_TOKEN_ID` (``bool`` is not an
integer); a logprob is a finite number <= 0 (see :mod:`trace_replay_app.rollouts` for why a
positive value is refused).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "MAX_TOKEN_ID",
    "LOGPROBS_MODES",
    "Invalid",
    "RequestBody",
    "Parsed",
    "show",
    "as_dict",
    "as_list",
    "required",
    "integer",
    "token_ids",
    "logprob",
    "logprob_list",
    "request_id",
    "logprobs_mode",
]

MAX_TOKEN_ID = 2**31 - 1
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
_LOGITS_MODES = ("raw_logits", "processed_logits")


class Invalid(ValueError):
    """A value that does not fit its format: ``field`` (or None for the whole line) and
    ``message``; ``path`` and ``line`` when the value is in another file (a requests file)."""

    def __init__(self, field: str | None, message: str, *, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.field, self.message, self.path, self.line = field, message, path, line


@dataclasses.dataclass
class RequestBody:
    """The request body sent for one response line: its file, line and decoded JSON value."""

    path: str
    line: int
    obj: Any


@dataclasses.dataclass
class Parsed:
    """One request read from a line: ids, token ids, logprobs and the fields they came from;
    ``prompt_at`` is the (path, line) of a prompt taken from a requests file."""

    id: str
    id_field: str
    prompt: tuple[int, ...]
    prompt_field: str
    trace: tuple[int, ...]
    trace_field: str
    logprobs: list[float] | None
    logprobs_mode: str | None = None
    prompt_at: tuple[str, int] | None = None


def show(value: Any) -> str:
    """``repr(value)``, cut to 40 characters for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_dict(value: Any, field: str | None) -> dict[str, Any]:
    """``value`` if it is a JSON object."""
    if not isinstance(value, dict):
        raise Invalid(field, f"must be a JSON object (got {type(value).__name__})")
    return value


def as_list(value: Any, field: str, what: str = "a list") -> list[Any]:
    """``value`` if it is a JSON array (``what`` describes the array expected)."""
    if not isinstance(value, list):
        raise Invalid(field, f"must be {what} (got {type(value).__name__})")
    return value


def required(obj: dict[str, Any], key: str, field: str, why: str = "") -> Any:
    """``obj[key]``, which must be present and not null (``why`` says how to get it)."""
    if obj.get(key) is None:
        raise Invalid(field, "missing" + (f": {why}" if why else ""))
    return obj[key]


def integer(value: Any, field: str, what: str = "", *, at: str = "") -> int:
    """A non-negative integer up to :data:`MAX_TOKEN_ID` (bool is not an integer); ``what`` and
    ``at`` name an entry of a list ("token id", " at index 3"), left out for a single value."""
    if isinstance(value, bool) or not isinstance(value, int):
        got = f"got {show(value)}{at}"
        raise Invalid(field, f"must hold integer {what}s ({got})" if what else f"must be an integer ({got})")
    if value < 0:
        raise Invalid(field, f"{what} {value}{at} is negative" if what else f"must not be negative (got {value})")
    if value > MAX_TOKEN_ID:
        big = f"{show(value)}{at} is too large (at most 2**31 - 1)"
        raise Invalid(field, f"{what} {big}" if what else big)
    return value


def token_ids(value: Any, field: str) -> tuple[int, ...]:
    """A non-empty list of token ids (see :func:`integer`)."""
    tokens = as_list(value, field, "a list of token ids")
    if not tokens:
        raise Invalid(field, "must not be empty")
    return tuple(integer(tok, field, "token id", at=f" at index {i}") for i, tok in enumerate(tokens))


def logprob(value: Any, field: str, what: str = "") -> float:
    """A finite number <= 0 (0.0 and -0.0 included; any positive value is refused); ``what``
    names an entry of a list ("entry 3"), left out for a single value."""
    said = f"{what} " if what else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(field, f"{said}must be a number (got {show(value)})")
    try:
        number = float(value)
    except OverflowError:
        raise Invalid(field, f"{said}is too large to be a logprob ({show(value)})") from None
    if math.isnan(number):
        raise Invalid(field, f"{said}is NaN")
    if math.isinf(number):
        raise Invalid(field, f"{said}is infinite ({number})")
    if number > 0:
        raise Invalid(field, f"{said}is {number!r}, above 0 (a logprob is at most 0)")
    return number


def logprob_list(value: Any, field: str, length: int, length_of: str) -> list[float]:
    """A list of ``length`` logprobs, one per token of the field ``length_of``."""
    values = as_list(value, field, "a list of logprobs")
    if len(values) != length:
        raise Invalid(field, f"holds {len(values)} logprobs but {length_of} holds {length} tokens")
    return [logprob(v, field, f"entry {i}") for i, v in enumerate(values)]


def request_id(value: Any, field: str) -> str:
    """A request id: a non-empty string, or an integer kept as its string."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise Invalid(field, f"must be a string or an integer (got {show(value)})")
    if not str(value):
        raise Invalid(field, "must not be empty")
    return str(value)


def logprobs_mode(obj: dict[str, Any], field: str) -> str | None:
    """The ``logprobs_mode`` the line records (vLLM's names), or None; logits modes are refused."""
    mode = obj.get("logprobs_mode")
    if mode is None or mode in LOGPROBS_MODES:
        return mode
    if mode in _LOGITS_MODES:
        raise Invalid(field, f"{mode!r}: the values are logits, not logprobs (give {' or '.join(LOGPROBS_MODES)})")
    raise Invalid(field, f"must be one of {', '.join(LOGPROBS_MODES)} (got {show(mode)})")
