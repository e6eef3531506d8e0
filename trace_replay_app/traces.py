"""Trace files: JSON Lines, one request per line (numpy-free, framework-free).

A line is a JSON object with:

- ``id``: a non-empty string or an integer (kept as its string), unique in the file;
- ``prompt`` (or ``prompt_token_ids``): the prompt's token ids, at least one;
- ``trace`` (or ``trace_token_ids`` / ``trace_decode_token_ids``): the token ids to force, one
  per decode step, at least one; or, for an untraced request, no trace (or ``null``) and
  ``max_new_tokens``: how many tokens to decode freely. With a trace, ``max_new_tokens`` may be
  given only if it equals the trace's length.

Other fields are ignored; blank lines are skipped. Token ids are non-negative integers below
the model's ``vocab_size``, and prompt + decoded tokens must fit in its ``n_positions`` (every
model family's config has both attributes). Trace files are untrusted input: nothing in a line
is evaluated, and every value is checked before use.
Every error names the file, the line (counting from 1) and the field, e.g.
``traces.jsonl, line 3, field "prompt": must not be empty``.

Output files are written through :func:`atomic_write`: a temporary file in the same folder,
renamed over the target only when complete and no Ctrl-C arrived (see :func:`sigint_tracked`),
so a failed or interrupted run leaves nothing behind.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import random
import secrets
import signal
import sys
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from .records import TraceRequest

__all__ = [
    "TraceFileError",
    "PROMPT_FIELDS",
    "TRACE_FIELDS",
    "read_traces",
    "read_json_lines",
    "text_lines",
    "utf8_text",
    "json_error",
    "parse_request",
    "check_request",
    "request_to_json",
    "write_traces",
    "random_requests",
    "atomic_write",
    "sigint_tracked",
    "interrupted",
    "stop_if_interrupted",
]

PROMPT_FIELDS = ("prompt", "prompt_token_ids")
TRACE_FIELDS = ("trace", "trace_token_ids", "trace_decode_token_ids")


class TraceFileError(ValueError):
    """A trace file that cannot be used; ``path``, ``line`` (1-based, or None for the whole
    file) and ``field`` (or None) say where."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.message = path, line, field, message
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if field is not None:
            where += f', field "{field}"'
        super().__init__(f"{where}: {message}")


class _FieldError(ValueError):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field, self.message = field, message


def _pick(obj: dict[str, Any], names: Sequence[str]) -> tuple[str | None, Any]:
    """The one field of ``names`` present (not null) in ``obj``: (name, value) or (None, None)."""
    present = [n for n in names if obj.get(n) is not None]
    if len(present) > 1:
        raise _FieldError(
            present[1], f'give only one of {", ".join(present)} (both "{present[0]}" and "{present[1]}" are set)'
        )
    return (present[0], obj[present[0]]) if present else (None, None)


def _token_ids(field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _FieldError(field, f"must be a list of token ids (got {type(value).__name__})")
    if not value:
        raise _FieldError(field, "must not be empty")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise _FieldError(field, f"must hold integer token ids (got {tok!r} at index {i})")
        if tok < 0:
            raise _FieldError(field, f"token id {tok} at index {i} is negative")
    return tuple(value)


def parse_request(obj: Any) -> TraceRequest:
    """One decoded JSON line -> :class:`TraceRequest`; raises ``ValueError`` with a ``field``
    attribute naming the offending field (use :func:`read_traces` for whole files)."""
    if not isinstance(obj, dict):
        raise _FieldError(None, f"must be a JSON object (got {type(obj).__name__})")
    if "id" not in obj or obj["id"] is None:
        raise _FieldError("id", "missing (every request needs an id)")
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise _FieldError("id", f"must be a string or an integer (got {rid!r})")
    rid = str(rid)
    if not rid:
        raise _FieldError("id", "must not be empty")
    prompt_field, prompt = _pick(obj, PROMPT_FIELDS)
    if prompt_field is None:
        raise _FieldError("prompt", f"missing (give the prompt's token ids as {' or '.join(PROMPT_FIELDS)})")
    prompt = _token_ids(prompt_field, prompt)
    trace_field, trace = _pick(obj, TRACE_FIELDS)
    max_new = obj.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise _FieldError("max_new_tokens", f"must be a positive integer (got {max_new!r})")
    if trace_field is None:
        if max_new is None:
            raise _FieldError(
                "max_new_tokens",
                f"missing: a request without a trace ({', '.join(TRACE_FIELDS)}) must say how many tokens to decode",
            )
        return TraceRequest(rid, prompt, None, max_new)
    trace = _token_ids(trace_field, trace)
    if max_new is not None and max_new != len(trace):
        raise _FieldError(
            "max_new_tokens",
            f"must equal the trace's length {len(trace)} or be left out "
            f"(got {max_new}; a traced request decodes exactly its trace)",
        )
    return TraceRequest(rid, prompt, trace, len(trace))


def check_request(request: TraceRequest, config: Any, *, fields: dict[str, str] | None = None) -> None:
    """Raise ``ValueError`` (with ``field``) if ``request`` does not fit ``config``: a token id
    not below ``vocab_size``, or prompt + decoded tokens beyond ``n_positions``. ``fields`` maps
    ``"prompt"``/``"trace"`` to the names the file used."""
    fields = fields or {}
    parts = [("prompt", request.prompt)] + ([("trace", request.trace)] if request.trace is not None else [])
    for part, tokens in parts:
        for i, tok in enumerate(tokens):
            if tok >= config.vocab_size:
                raise _FieldError(
                    fields.get(part, part),
                    f"token id {tok} at index {i} is not below the model's vocab_size {config.vocab_size}",
                )
    total = len(request.prompt) + request.new_tokens
    if total > config.n_positions:
        what = "trace" if request.trace is not None else "max_new_tokens"
        raise _FieldError(
            fields.get(what, what),
            f"prompt ({len(request.prompt)}) + decoded tokens ({request.new_tokens}) = {total} "
            f"exceed the model's n_positions {config.n_positions}",
        )


def read_json_lines(path: str) -> Iterator[tuple[int, Any]]:
    """Each non-blank line of the JSON Lines file ``path`` as (line number from 1, decoded value).

    The file is UTF-8 (a leading byte-order mark is skipped). Raises :class:`TraceFileError`
    naming the line for bytes that are not UTF-8, text that is not JSON, JSON nested too deeply
    or an integer literal too long for Python to read; ``OSError`` if the file cannot be read.
    """
    for number, text in text_lines(path):
        try:
            obj = json.loads(text)
        except (RecursionError, ValueError) as exc:  # ValueError: JSONDecodeError, or an over-long integer
            raise json_error(path, number, exc) from None
        yield number, obj


def text_lines(path: str) -> Generator[tuple[int, str], None, None]:
    """Each non-blank line of ``path`` as (line number from 1, text), decoded as UTF-8 (a leading
    byte-order mark skipped); :class:`TraceFileError` naming the line for bytes that are not
    UTF-8; ``OSError`` if the file cannot be read."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            text = utf8_text(path, raw, number)
            if text.strip():
                yield number, text


def utf8_text(path: str, raw: bytes, line: int = 1) -> str:
    """``raw``, the bytes of ``path`` from line ``line`` on, decoded as UTF-8; else
    :class:`TraceFileError` naming the line and column of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        line += raw.count(b"\n", 0, exc.start)
        raise TraceFileError(path, line, None, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})") from None


def json_error(path: str, line: int | None, exc: BaseException) -> TraceFileError:
    """The :class:`TraceFileError` for a JSON value at ``line`` of ``path`` that ``json`` could
    not read (``exc``): a ``JSONDecodeError`` (with its column), a ``RecursionError`` (nested
    too deeply) or a ``ValueError`` (an integer literal of more digits than Python converts)."""
    if isinstance(exc, json.JSONDecodeError):
        return TraceFileError(path, line, None, f"not valid JSON ({exc.msg} at column {exc.colno})")
    if isinstance(exc, RecursionError):
        return TraceFileError(path, line, None, "not valid JSON here (nested too deeply to read)")
    return TraceFileError(path, line, None, f"not valid JSON here ({str(exc).split(';')[0]})")


def read_traces(path: str, config: Any | None = None) -> list[TraceRequest]:
    """Every request of the JSON Lines file ``path``, in file order; checked against ``config``
    (token ids below ``vocab_size``, lengths within ``n_positions``) when one is given.

    The file is UTF-8 (a leading byte-order mark is skipped). Raises :class:`TraceFileError`
    naming the line and field of the first problem (also for bytes that are not UTF-8, JSON
    nested too deeply or an integer literal too long for Python to read, duplicate ids and a
    file without requests), ``OSError`` if the file cannot be read.
    """
    requests: list[TraceRequest] = []
    first_line: dict[str, int] = {}
    for number, obj in read_json_lines(path):
        try:
            request = parse_request(obj)
            if config is not None:
                used = {"prompt": _pick(obj, PROMPT_FIELDS)[0], "trace": _pick(obj, TRACE_FIELDS)[0]}
                check_request(request, config, fields={k: v for k, v in used.items() if v})
        except _FieldError as exc:
            raise TraceFileError(path, number, exc.field, exc.message) from None
        if request.id in first_line:
            raise TraceFileError(
                path, number, "id", f"duplicate id {request.id!r} (first on line {first_line[request.id]})"
            )
        first_line[request.id] = number
        requests.append(request)
    if not requests:
        raise TraceFileError(path, None, None, "holds no requests (one JSON object per line)")
    return requests


def request_to_json(request: TraceRequest) -> dict[str, Any]:
    """The trace-file object of ``request`` (``id``, ``prompt``, then ``trace`` or
    ``max_new_tokens``)."""
    out: dict[str, Any] = {"id": request.id, "prompt": [int(t) for t in request.prompt]}
    if request.trace is not None:
        out["trace"] = [int(t) for t in request.trace]
    else:
        out["max_new_tokens"] = int(request.max_new_tokens)
    return out


def write_traces(path: str, requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as a trace file (atomically: see :func:`atomic_write`)."""
    with atomic_write(path) as f:
        for request in requests:
            f.write(json.dumps(request_to_json(request), separators=(",", ":")) + "\n")


def random_requests(
    config: Any,
    n: int,
    *,
    seed: int = 0,
    traced: float = 1.0,
    prompt_len: tuple[int, int] = (1, 24),
    new_tokens: tuple[int, int] = (1, 24),
    prefix: str = "r",
) -> list[TraceRequest]:
    """``n`` requests of uniformly random token ids, for tests, smoke runs and benchmarks.

    Prompt lengths and decoded-token counts are drawn from the inclusive ranges given (clipped
    so that each request fits ``n_positions``); a fraction ``traced`` of them (the first ones
    in a shuffled order) carry a random trace, the rest decode freely. Ids are
    ``f"{prefix}{i}"``. Deterministic in ``seed``.
    """
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    is_traced = set(order[: round(traced * n)])
    out = []
    for i in range(n):
        p = rng.randint(*prompt_len)
        p = max(1, min(p, config.n_positions - 1))
        k = max(1, min(rng.randint(*new_tokens), config.n_positions - p))
        prompt = tuple(rng.randrange(config.vocab_size) for _ in range(p))
        if i in is_traced:
            out.append(
                TraceRequest(f"{prefix}{i}", prompt, tuple(rng.randrange(config.vocab_size) for _ in range(k)), k)
            )
        else:
            out.append(TraceRequest(f"{prefix}{i}", prompt, None, k))
    return out


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file next to ``path`` for writing; on a clean exit it replaces ``path``
    (``os.replace``), on an exception, or after a Ctrl-C inside :func:`sigint_tracked` (even one
    a framework swallowed: ``KeyboardInterrupt``), it is removed and ``path`` is left as it was."""
    stop_if_interrupted()
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask set the final permissions, as a plain open() would.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding="utf-8") as f:
            yield f
        stop_if_interrupted()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# Ctrl-C ------------------------------------------------------------------------------------------
_SIGINT = {"received": False}


@contextlib.contextmanager
def sigint_tracked() -> Iterator[None]:
    """Within: Ctrl-C (SIGINT) is recorded, then raises ``KeyboardInterrupt`` as usual, so that
    an interrupt a framework wraps in another exception (a ``KeyboardInterrupt`` raised in a
    JAX callback arrives as an "INTERNAL" error) is still known as one (:func:`interrupted`).

    Only the first Ctrl-C raises: further ones in the block are ignored, since the block is
    then ending and a second ``KeyboardInterrupt`` could escape the code that handles the first.
    A recorded ``KeyboardInterrupt`` that Python cannot raise (the Ctrl-C landed in a
    ``__del__`` or a weakref callback, as during an import) is not printed as "Exception
    ignored": the next :func:`stop_if_interrupted` acts on it. The previous handler and
    ``sys.unraisablehook`` are restored on exit; outside the main thread nothing is installed."""
    _SIGINT["received"] = False

    def handle(signum, frame):
        if _SIGINT["received"]:
            return
        _SIGINT["received"] = True
        raise KeyboardInterrupt

    def unraisable(info):
        if not (_SIGINT["received"] and isinstance(info.exc_value, KeyboardInterrupt)):
            previous_hook(info)

    try:
        previous = signal.signal(signal.SIGINT, handle)
    except ValueError:  # not the main thread: Python delivers signals to the main thread only
        previous = None
    previous_hook = sys.unraisablehook
    if previous is not None:
        sys.unraisablehook = unraisable
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            sys.unraisablehook = previous_hook
        _SIGINT["received"] = False


def interrupted() -> bool:
    """Whether a Ctrl-C arrived inside the current :func:`sigint_tracked` block."""
    return _SIGINT["received"]


def stop_if_interrupted() -> None:
    """``KeyboardInterrupt`` if a Ctrl-C arrived (even one that a framework swallowed)."""
    if _SIGINT["received"]:
        raise KeyboardInterrupt
