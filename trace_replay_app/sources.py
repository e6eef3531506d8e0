"""Sources of logprobs for ``compare``: what an engine wrote, what ``run`` and ``score`` wrote.

A :class:`Source` is one set of results for requests, by id: per request the tokens and the
logprob of each under that source's model and view, with ranks and greedy tokens where the
source has them, and what the source says of each request itself (:class:`Described`: its
prompt, and whether its tokens were given or decoded freely). :func:`load_source` reads a file:

- the output of ``trace-replay run`` or ``score`` (one JSON document with ``summary`` and
  ``requests``): named ``<framework>`` (decode with replay, as ``compare --run`` names its
  runs) or ``<framework>-score`` after its summary;
- a rollout file in any format :func:`~trace_replay_app.rollouts.read_rollouts` reads, whose
  every request carries the engine's logprobs: named ``rollout`` (its ranks and greedy tokens
  are unknown: -1).

The two are told apart by the first non-blank line: a complete JSON value there that is not an
output document makes a JSON Lines file, read line by line; only an output document is read
whole. Both are untrusted input: every value is checked as the rollout readers check theirs
(token ids, logprobs: finite and <= 0, or null where ``run`` wrote a non-finite one), and an
error names the file, the line and the field (:class:`~trace_replay_app.traces.TraceFileError`).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .records import RequestResult, TraceRequest
from .rollout_fields import Invalid, logprob
from .rollouts import ROLLOUT_FORMATS, detect_format, read_rollouts
from .traces import TraceFileError, json_error, text_lines, utf8_text

__all__ = [
    "Source",
    "Described",
    "load_source",
    "results_source",
    "output_requests",
    "requests_file_for",
    "unique_names",
    "is_output_document",
    "check_same_requests",
    "UNKNOWN",
]

UNKNOWN = -1  # a rank or greedy token the source does not have


@dataclasses.dataclass(frozen=True)
class Described:
    """What a source says of one request beside its results: ``prompt_len``, the ``prompt``'s
    token ids (None where the source records only the length: an output of run or score) and
    whether its tokens were ``traced`` (given: a trace, a rollout's sampled tokens) rather than
    decoded freely."""

    prompt_len: int
    traced: bool
    prompt: tuple[int, ...] | None = None

    @classmethod
    def of(cls, request: TraceRequest) -> Described:
        return cls(len(request.prompt), request.trace is not None, tuple(request.prompt))


@dataclasses.dataclass(frozen=True, eq=False)
class Source:
    """``name``; ``results`` by request id; ``view``: ``"rollout"``, ``"decode"`` or
    ``"teacher-forced"``; ``path``; ``requests`` (those it read, for a rollout file, else None);
    ``logprobs_mode``: vLLM's name of what its logprobs are (None where the file does not say);
    ``described``: each request as the source describes it, by id."""

    name: str
    results: Mapping[str, RequestResult]
    view: str
    path: str | None = None
    requests: Sequence[TraceRequest] | None = None
    logprobs_mode: str | None = None
    described: Mapping[str, Described] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        """The source as messages name it: its name, and its file where it has one."""
        return self.name if self.path is None else f"{self.name} ({self.path})"


def results_source(
    name: str, view: str, results: Sequence[RequestResult], logprobs_mode: str, requests: Sequence[TraceRequest]
) -> Source:
    """A source of results made in this process (``--run``/``--score``) from ``requests``."""
    described = {q.id: Described.of(q) for q in requests}
    return Source(name, {r.id: r for r in results}, view, logprobs_mode=logprobs_mode, described=described)


def output_requests(source: Source) -> list[TraceRequest]:
    """The requests of an output of run or score as far as it records them: ids, tokens (the
    trace of a traced request; an untraced one decoded as many) and the prompt's length (its
    ids unknown: zeros)."""
    requests = []
    for rid, r in source.results.items():
        about = source.described[rid]
        tokens = tuple(int(t) for t in r.tokens)
        requests.append(TraceRequest(rid, (0,) * about.prompt_len, tokens if about.traced else None, len(tokens)))
    return requests


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _output_keys(value: Any) -> bool:
    return isinstance(value, dict) and "summary" in value and "requests" in value


def _first_value(path: str) -> tuple[bool, Any]:
    """``(complete, value)`` of the first non-blank line of ``path``: whether it holds a whole
    JSON value, and that value (None for an empty file or an incomplete line)."""
    with contextlib.closing(text_lines(path)) as lines:
        for number, text in lines:
            try:
                return True, json.loads(text)
            except json.JSONDecodeError:
                return False, None  # a value over several lines: a document
            except (RecursionError, ValueError) as exc:
                raise json_error(path, number, exc) from None
    return True, None


def is_output_document(path: str) -> bool:
    """Whether ``path`` holds an output of run or score rather than JSON Lines, told from its
    first non-blank line (a JSON Lines file has a whole JSON value there, and that value is not
    itself an output document). Raises :class:`TraceFileError` for a first line that is not
    UTF-8 or that ``json`` cannot read; ``OSError``."""
    complete, first = _first_value(path)
    return not complete or _output_keys(first)


def _document(path: str) -> tuple[dict[str, Any], dict[str, int], list[int]]:
    """The JSON object in ``path`` (read whole), the line of each of its keys and the line of
    each entry of its ``requests`` array; :class:`TraceFileError` naming the line of what is not
    UTF-8 or not JSON."""
    with open(path, "rb") as f:
        raw = f.read()
    text = utf8_text(path, raw[len(codecs.BOM_UTF8) :] if raw.startswith(codecs.BOM_UTF8) else raw)

    def line(at: int) -> int:
        return text.count("\n", 0, at) + 1

    def skip(at: int) -> int:
        match = _WHITESPACE.match(text, at)
        assert match is not None
        return match.end()

    def value(at: int) -> tuple[Any, int]:
        try:
            return _DECODER.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            raise json_error(path, exc.lineno, exc) from None
        except (RecursionError, ValueError) as exc:
            raise json_error(path, line(at), exc) from None

    def expect(at: int, chars: str) -> str:
        if at >= len(text) or text[at] not in chars:
            got = repr(text[at]) if at < len(text) else "the end of the file"
            raise TraceFileError(path, line(at), None, f"not valid JSON (expected {' or '.join(chars)}, got {got})")
        return text[at]

    doc: dict[str, Any] = {}
    key_lines: dict[str, int] = {}
    entry_lines: list[int] = []

    def items(at: int, close: str, read) -> int:  # comma-separated items up to `close`, each read(at) -> at
        at = skip(at)
        if text[at : at + 1] == close:
            return at + 1
        while True:
            at = skip(read(at))
            if expect(at, "," + close) == close:
                return at + 1
            at = skip(at + 1)

    def entry(at: int) -> int:
        entry_lines.append(line(at))
        item, at = value(at)
        doc["requests"].append(item)
        return at

    def member(at: int) -> int:
        expect(at, '"')
        where = line(at)
        key, at = value(at)
        at = skip(at)
        expect(at, ":")
        at = skip(at + 1)
        key_lines[key] = where
        if key == "requests" and text[at : at + 1] == "[":
            doc[key] = []
            entry_lines.clear()
            return items(at + 1, "]", entry)
        doc[key], at = value(at)
        return at

    at = skip(0)
    expect(at, "{")
    at = skip(items(at + 1, "}", member))
    if at != len(text):
        raise TraceFileError(path, line(at), None, "not valid JSON (more after the document's end)")
    return doc, key_lines, entry_lines


def _ints(where: str, field: str, value: Any, n: int | None, low: int) -> np.ndarray:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise Invalid(field, f"{where}: must be a list of integers")
    if n is not None and len(value) != n:
        raise Invalid(field, f"{where}: holds {len(value)} entries, tokens {n}")
    if any(not low <= v < 2**63 for v in value):
        raise Invalid(field, f"{where}: entries must lie in [{low}, 2**63)")
    return np.asarray(value, np.int64)


def _logprobs(where: str, value: Any, n: int) -> np.ndarray:
    """The logprobs of a request of an output: a list as long as its tokens of logprobs as the
    rollout readers take them (finite, <= 0), or null where the run's was not finite."""
    if not isinstance(value, list) or len(value) != n:
        raise Invalid("requests.logprobs", f"{where}: must be a list as long as tokens")
    field = "requests.logprobs"
    return np.asarray(
        [math.nan if v is None else logprob(v, field, f"{where}: entry {i}") for i, v in enumerate(value)]
    )


def _request(where: str, r: Any, seen: Mapping[str, Any]) -> tuple[RequestResult, Described]:
    if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not r["id"]:
        raise Invalid("requests.id", f"{where}: must be an object with a non-empty string id")
    where = f"{where} ({r['id']!r})"
    if r["id"] in seen:
        raise Invalid("requests.id", f"{where}: the id appears twice")
    tokens = _ints(where, "requests.tokens", r.get("tokens"), None, 0)
    values = _logprobs(where, r.get("logprobs"), tokens.size)
    forced = r.get("forced")
    if not isinstance(forced, list) or len(forced) != tokens.size or not all(isinstance(f, bool) for f in forced):
        raise Invalid("requests.forced", f"{where}: must be a list of booleans as long as tokens")
    ranks = _ints(where, "requests.ranks", r.get("ranks"), tokens.size, -1)
    argmax = _ints(where, "requests.argmax", r.get("argmax"), tokens.size, 0)
    prompt_len, traced = r.get("prompt_len"), r.get("traced")
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise Invalid("requests.prompt_len", f"{where}: must be a positive integer (got {prompt_len!r})")
    if not isinstance(traced, bool):
        raise Invalid("requests.traced", f"{where}: must be true or false (got {traced!r})")
    result = RequestResult(r["id"], tokens, np.asarray(forced, bool), values, ranks, argmax)
    return result, Described(prompt_len, traced)


def _from_output(path: str) -> Source:
    doc, key_lines, entry_lines = _document(path)
    if not _output_keys(doc):
        raise TraceFileError(path, 1, None, "one JSON object without summary and requests: neither an output of "
                             "run or score nor JSON Lines (one value per line)")  # fmt: skip
    summary, at = doc["summary"], key_lines["summary"]
    if not isinstance(summary, dict) or summary.get("framework") not in ("torch", "jax"):
        raise TraceFileError(path, at, "summary.framework", "must be torch or jax (an output of run or score)")
    mode = summary.get("logprobs_mode", "raw_logprobs")
    if mode not in ("raw_logprobs", "processed_logprobs"):
        raise TraceFileError(
            path, at, "summary.logprobs_mode", f"must be raw_logprobs or processed_logprobs (got {mode!r})"
        )
    view = "teacher-forced" if summary.get("view") == "teacher-forced" else "decode"
    name = f"{summary['framework']}-score" if view == "teacher-forced" else summary["framework"]
    if not isinstance(doc["requests"], list):
        raise TraceFileError(path, key_lines["requests"], "requests", "must be a list")
    results: dict[str, RequestResult] = {}
    described: dict[str, Described] = {}
    for i, (r, line) in enumerate(zip(doc["requests"], entry_lines, strict=True)):
        try:
            result, about = _request(f"request {i + 1}", r, results)
        except Invalid as exc:
            raise TraceFileError(path, line, exc.field, exc.message) from None
        results[result.id], described[result.id] = result, about
    return Source(name, results, view, path, logprobs_mode=mode, described=described)


def load_source(
    path: str, config: Any | None = None, *, format: str = "auto", requests_path: str | None = None
) -> Source:
    """The source in the file ``path`` (see the module docstring); with ``config``, a rollout's
    token ids are checked against it. Raises :class:`TraceFileError` (or ``OSError``)."""
    if is_output_document(path):
        return _from_output(path)
    rollouts = read_rollouts(path, config, format=format, requests_path=requests_path)
    results: dict[str, RequestResult] = {}
    for r in rollouts:
        if r.logprobs is None:
            raise TraceFileError(path, r.line, "logprobs", f"request {r.request.id!r} has no logprobs to compare")
        n = r.logprobs.size
        results[r.request.id] = RequestResult(
            r.request.id,
            np.asarray(r.request.trace, np.int64),
            np.ones(n, bool),
            np.asarray(r.logprobs, np.float64),
            np.full(n, UNKNOWN, np.int64),
            np.full(n, UNKNOWN, np.int64),
        )
    modes = {r.logprobs_mode for r in rollouts if r.logprobs_mode is not None}
    if len(modes) > 1:
        raise TraceFileError(path, None, "logprobs_mode", f"differs between lines ({', '.join(sorted(modes))})")
    mode = modes.pop() if modes else None
    described = {r.request.id: Described.of(r.request) for r in rollouts}
    return Source("rollout", results, "rollout", path, [r.request for r in rollouts], mode, described)


def requests_file_for(paths: Sequence[str], format: str, requests_path: str) -> str:
    """The one of ``paths`` (rollout files and outputs of run or score) that the request bodies
    ``requests_path`` go with: the openai-completions file among them (``format``, or told from
    its first line; one path given twice is one file). ``ValueError`` when there is none or
    more than one; :class:`TraceFileError` or ``OSError`` from reading a first line."""
    completions: dict[str, str] = {}
    for path in paths:
        if not is_output_document(path) and (format if format != "auto" else detect_format(path)) == ROLLOUT_FORMATS[1]:
            completions.setdefault(os.path.realpath(path), path)
    found = list(completions.values())
    if not found:
        raise ValueError(f"--requests {requests_path}: the request bodies of an openai-completions file, and none "
                         f"of {', '.join(paths)} is one")  # fmt: skip
    if len(found) > 1:
        raise ValueError(f"--requests {requests_path}: goes with one openai-completions file, and {found[0]} and "
                         f"{found[1]} are both")  # fmt: skip
    return found[0]


def unique_names(sources: Sequence[Source]) -> list[Source]:
    """``sources`` with unique names (a repeated name gets ``#2``, ``#3``, ...)."""
    seen: dict[str, int] = {}
    out = []
    for s in sources:
        seen[s.name] = seen.get(s.name, 0) + 1
        out.append(s if seen[s.name] == 1 else dataclasses.replace(s, name=f"{s.name}#{seen[s.name]}"))
    return out


def check_same_requests(
    requests: Sequence[TraceRequest], sources: Sequence[Source], reference: str | None = None
) -> None:
    """``ValueError`` naming the request, two sources and what differs unless every one of
    ``sources`` holds every request of ``requests`` and all describe it alike: the same prompt
    (its ids, or its length where a source records only that) and, where two sources both give
    its tokens (a trace, a rollout's sampled tokens), the same tokens. ``reference`` names where
    ``requests`` were read (``--traces FILE``), which then counts as one more source; None when
    they came from one of ``sources``."""
    for q in requests:
        seen = [] if reference is None else [(reference, Described.of(q), q.trace)]
        for s in sources:
            if q.id not in s.results:
                raise ValueError(f"source {s.label} has no result for request {q.id!r}")
            about = s.described.get(q.id)
            if about is not None:
                seen.append((s.label, about, tuple(int(t) for t in s.results[q.id].tokens) if about.traced else None))
        if seen:
            _same(q.id, "prompts", [(who, about.prompt_len, about.prompt) for who, about, _ in seen])
            _same(q.id, "tokens", [(who, len(tokens), tokens) for who, _, tokens in seen if tokens is not None])


def _same(rid: str, what: str, seen: Sequence[tuple[str, int, tuple[int, ...] | None]]) -> None:
    """``ValueError`` unless every ``(who, length, ids or None)`` of ``seen`` agrees with the first
    on the length and with the first that has ids on the ids."""
    if not seen:
        return
    first, length, _ = seen[0]
    for who, n, _ in seen[1:]:
        if n != length:
            raise ValueError(f"request {rid!r}: the {what} differ between {first} and {who} ({length} and {n} tokens)")
    with_ids = [(who, ids) for who, _, ids in seen if ids is not None]
    for who, ids in with_ids[1:]:
        at = next((i for i, (a, b) in enumerate(zip(with_ids[0][1], ids)) if a != b), None)
        if at is not None:
            raise ValueError(
                f"request {rid!r}: the {what} differ between {with_ids[0][0]} and {who} "
                f"(token {at}: {with_ids[0][1][at]} and {ids[at]})"
            )
