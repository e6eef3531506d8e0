"""Sources of logprobs for ``compare``: what an engine wrote, what ``run`` and ``score`` wrote.

A :class:`Source` is one set of results for requests, by id: per request the tokens and the
logprob of each under that source's model and view, with ranks and greedy tokens where the
source has them. :func:`load_source` reads a file:

- the output of ``trace-replay run`` or ``score`` (one JSON document with ``summary`` and
  ``requests``): named ``<framework>`` (decode with replay, as ``compare --run`` names its
  runs) or ``<framework>-score`` after its summary;
- a rollout file in any format :func:`~trace_replay_app.rollouts.read_rollouts` reads, whose
  every request carries the engine's logprobs: named ``rollout`` (its ranks and greedy tokens
  are unknown: -1).

Both are untrusted input: every value is checked, and an error names the file, the request
and the field (:class:`~trace_replay_app.traces.TraceFileError`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .records import RequestResult, TraceRequest
from .rollouts import read_rollouts
from .traces import TraceFileError

__all__ = ["Source", "load_source", "results_source", "UNKNOWN"]

UNKNOWN = -1  # a rank or greedy token the source does not have


@dataclasses.dataclass(frozen=True, eq=False)
class Source:
    """``name``; ``results`` by request id; ``requests`` (those it read, for a rollout file,
    else None); ``view``: ``"rollout"``, ``"decode"`` or ``"teacher-forced"``; ``path``;
    ``logprobs_mode``: vLLM's name of what its logprobs are (None where the file does not say)."""

    name: str
    results: Mapping[str, RequestResult]
    view: str
    path: str | None = None
    requests: Sequence[TraceRequest] | None = None
    logprobs_mode: str | None = None


def results_source(name: str, view: str, results: Sequence[RequestResult], logprobs_mode: str) -> Source:
    """A source of results made in this process (``--run``/``--score``)."""
    return Source(name, {r.id: r for r in results}, view, logprobs_mode=logprobs_mode)


def _looks_like_output(path: str) -> Any:
    """The parsed document if ``path`` holds one JSON object with ``summary`` and ``requests``
    (an output of run or score), else None."""
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 16)
        if not head.lstrip().startswith("{"):
            return None
        try:
            doc = json.loads(head + f.read())
        except json.JSONDecodeError:
            return None  # JSON Lines (several objects): a rollout file
    return doc if isinstance(doc, dict) and "summary" in doc and "requests" in doc else None


def _ints(path: str, where: str, field: str, value: Any, n: int | None, low: int) -> np.ndarray:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TraceFileError(path, None, field, f"{where}: must be a list of integers")
    if n is not None and len(value) != n:
        raise TraceFileError(path, None, field, f"{where}: holds {len(value)} entries, tokens {n}")
    if any(not low <= v < 2**63 for v in value):
        raise TraceFileError(path, None, field, f"{where}: entries must lie in [{low}, 2**63)")
    return np.asarray(value, np.int64)


def _from_output(path: str, doc: dict) -> Source:
    summary = doc["summary"]
    if not isinstance(summary, dict) or summary.get("framework") not in ("torch", "jax"):
        raise TraceFileError(path, None, "summary.framework", "must be torch or jax (an output of run or score)")
    view = "teacher-forced" if summary.get("view") == "teacher-forced" else "decode"
    name = f"{summary['framework']}-score" if view == "teacher-forced" else summary["framework"]
    if not isinstance(doc["requests"], list):
        raise TraceFileError(path, None, "requests", "must be a list")
    results: dict[str, RequestResult] = {}
    for i, r in enumerate(doc["requests"]):
        where = f"request {i + 1}"
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not r["id"]:
            raise TraceFileError(path, None, "requests.id", f"{where}: must be an object with a non-empty string id")
        where = f"request {i + 1} ({r['id']!r})"
        if r["id"] in results:
            raise TraceFileError(path, None, "requests.id", f"{where}: the id appears twice")
        tokens = _ints(path, where, "requests.tokens", r.get("tokens"), None, 0)
        lp = r.get("logprobs")
        if not isinstance(lp, list) or len(lp) != tokens.size:
            raise TraceFileError(path, None, "requests.logprobs", f"{where}: must be a list as long as tokens")
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))) for v in lp):
            raise TraceFileError(path, None, "requests.logprobs", f"{where}: entries must be numbers or null")
        values = np.asarray([math.nan if v is None else float(v) for v in lp], np.float64)
        forced = r.get("forced")
        if not isinstance(forced, list) or len(forced) != tokens.size or not all(isinstance(f, bool) for f in forced):
            raise TraceFileError(
                path, None, "requests.forced", f"{where}: must be a list of booleans as long as tokens"
            )
        ranks = _ints(path, where, "requests.ranks", r.get("ranks"), tokens.size, -1)
        argmax = _ints(path, where, "requests.argmax", r.get("argmax"), tokens.size, 0)
        results[r["id"]] = RequestResult(r["id"], tokens, np.asarray(forced, bool), values, ranks, argmax)
    mode = summary.get("logprobs_mode", "raw_logprobs")
    if mode not in ("raw_logprobs", "processed_logprobs"):
        raise TraceFileError(
            path, None, "summary.logprobs_mode", f"must be raw_logprobs or processed_logprobs (got {mode!r})"
        )
    return Source(name, results, view, path, logprobs_mode=mode)


def load_source(
    path: str, config: Any | None = None, *, format: str = "auto", requests_path: str | None = None
) -> Source:
    """The source in the file ``path`` (see the module docstring); with ``config``, a rollout's
    token ids are checked against it. Raises :class:`TraceFileError` (or ``OSError``)."""
    doc = _looks_like_output(path)
    if doc is not None:
        return _from_output(path, doc)
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
    return Source("rollout", results, "rollout", path, [r.request for r in rollouts], mode)
