"""What ``run`` and ``score`` write: one JSON object per request (:func:`result_to_json`), the
run's counts (:func:`run_summary`) and the document around them (:func:`write_json_document`).
Host-only, numpy and the standard library."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from .records import RequestResult, TraceRequest
from .traces import atomic_write

__all__ = [
    "finite_or_none",
    "reproduced",
    "result_to_json",
    "run_summary",
    "non_finite_requests",
    "write_json_document",
]


def finite_or_none(x) -> float | None:
    """``float(x)``, or None when it is not finite (JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def reproduced(request: TraceRequest, result: RequestResult) -> bool | None:
    """Whether a traced request's tokens equal its trace (None for an untraced request)."""
    if request.trace is None:
        return None
    return [int(t) for t in result.tokens] == list(request.trace)


def result_to_json(request: TraceRequest, result: RequestResult) -> dict[str, Any]:
    """One request of a ``run`` output file: ``id``, ``traced``, ``reproduced`` (traced
    requests: tokens equal the trace; null otherwise), ``prompt_len``, and per decoded token
    ``tokens``, ``forced``, ``logprobs`` (null where not finite), ``ranks``, ``argmax``, and
    ``entropy`` where the run computed it (``score``), and ``topk_logprobs`` / ``topk_ids`` (one
    list of ``k`` per token, most likely first) with ``score --top-k``."""
    return {
        "id": request.id,
        "traced": request.trace is not None,
        "reproduced": reproduced(request, result),
        "prompt_len": len(request.prompt),
        "tokens": [int(t) for t in result.tokens],
        "forced": [bool(f) for f in result.forced],
        "logprobs": [finite_or_none(x) for x in result.logprobs],
        "ranks": [int(r) for r in result.ranks],
        "argmax": [int(a) for a in result.argmax],
        **({} if result.entropy is None else {"entropy": [finite_or_none(x) for x in result.entropy]}),
        **({} if result.topk_ids is None else _topk_json(result)),
    }


def _topk_json(result: RequestResult) -> dict[str, Any]:
    assert result.topk_logprobs is not None and result.topk_ids is not None
    return {
        "topk_logprobs": [[finite_or_none(x) for x in row] for row in result.topk_logprobs],
        "topk_ids": [[int(i) for i in row] for row in result.topk_ids],
    }


def run_summary(requests: Sequence[TraceRequest], results: Sequence[RequestResult], seconds: float) -> dict[str, Any]:
    """Counts and rates of one run: requests, traced requests, tokens, forced tokens, seconds,
    tokens/s, exact reproductions (traced requests whose tokens equal their trace), and the
    mean logprob and rank of the forced tokens."""
    tokens = sum(len(r.tokens) for r in results)
    forced_lp = [float(lp) for r in results for lp, f in zip(r.logprobs, r.forced, strict=True) if f]
    forced_rank = [int(rk) for r in results for rk, f in zip(r.ranks, r.forced, strict=True) if f]
    traced = [(q, r) for q, r in zip(requests, results, strict=True) if q.trace is not None]
    bad = non_finite_requests(requests, results)
    return {
        "requests": len(requests),
        "traced_requests": len(traced),
        "tokens": tokens,
        "forced_tokens": len(forced_lp),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "exact_reproductions": sum(bool(reproduced(q, r)) for q, r in traced),
        "mean_forced_logprob": finite_or_none(sum(forced_lp) / len(forced_lp)) if forced_lp else None,
        "mean_forced_rank": sum(forced_rank) / len(forced_rank) if forced_rank else None,
        "non_finite_logprobs": sum(bad.values()),
        "requests_with_non_finite_logprobs": list(bad),
    }


def non_finite_requests(requests: Sequence[TraceRequest], results: Sequence[RequestResult]) -> dict[str, int]:
    """``{request id: how many of its logprobs are not finite}`` for the requests that have any
    (written as null in the outputs: JSON has no NaN), in request order."""
    counts = {
        q.id: int(len(r.logprobs) - sum(math.isfinite(float(x)) for x in r.logprobs))
        for q, r in zip(requests, results, strict=True)
    }
    return {rid: n for rid, n in counts.items() if n}


def write_json_document(path: str, head: dict[str, Any], key: str, rows: Sequence[dict[str, Any]]) -> None:
    """``{**head, key: rows}`` as JSON with one row per line (atomically; not after Ctrl-C)."""
    with atomic_write(path) as f:
        f.write("{")
        for name, value in head.items():
            f.write(f"{json.dumps(name)}: {json.dumps(value, indent=1, allow_nan=False)},\n")
        f.write(f"{json.dumps(key)}: [\n")
        f.write(",\n".join(json.dumps(r, allow_nan=False, separators=(",", ":")) for r in rows))
        f.write("\n]}\n")
