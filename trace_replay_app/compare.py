"""Compare sources of logprobs for the same requests token by token: a pair ``a`` and ``b`` (two
runs, a rollout and a run, a decode and a teacher-forced score), and several sources as the
first (the reference) against each of the others.

For each request, positions are comparable while both sources hold the same tokens so far: for
a traced request that is every position (both hold its trace); for an untraced one it ends at
the first position where they chose different tokens (after it, the two condition on
different sequences). At each comparable position the report holds the logprob difference
``d = b - a`` of the chosen token, and it names the first position where the two sides' argmax
choices differ (where both have them), which is where greedy decoding of the two would part.

The measures RL teams track for train/rollout mismatch, per request and over all compared
positions: mean and max ``|d|``; mean and max ``|exp(b) - exp(a)|`` (probability of the
token); the k3 estimate of KL(a || b), ``mean(exp(d) - 1 - d)`` (non-negative, unbiased for
tokens drawn from ``a``); the Pearson correlation of the two logprob sequences; how many
positions' argmax differ; and the first divergent position (argmax or token, whichever first).

:func:`compare_results` builds the report of a pair (a JSON-ready dict), :func:`compare_sources`
that of several sources; :mod:`trace_replay_app.compare_plots` draws them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .metrics import rl_metrics
from .records import RequestResult, TraceRequest
from .runner import CliError, check_outputs

__all__ = [
    "compare_results",
    "compare_sources",
    "batch_gate_failures",
    "pair_reports",
    "summary_lines",
    "mismatch_measures",
    "gate_failures",
    "output_paths",
    "GATED_MEASURES",
    "RL_METRIC_KEYS",
]

# the per-request measures a gate (``--max-k3``) may bound
GATED_MEASURES = ("k3", "mean_abs_logprob_diff", "max_abs_logprob_diff", "mean_abs_prob_diff", "max_abs_prob_diff")
# the batch measures of every pair a gate (``--fail-above``) may bound: the keys of ``rl_metrics``
RL_METRIC_KEYS = tuple(rl_metrics(train=[], rollout=[]).batch)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _num(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _rms(x: np.ndarray) -> float:
    """Root mean square, scaled by the largest magnitude first, so that squares of differences
    beyond 1e154 do not overflow (the result is finite whenever the differences are)."""
    top = float(np.abs(x).max())
    return 0.0 if top == 0.0 else top * float(np.sqrt(np.mean((x / top) ** 2)))


def mismatch_measures(la: np.ndarray, lb: np.ndarray) -> dict[str, Any]:
    """The mismatch measures of two logprob sequences of the same tokens (float64, equal length,
    finite entries only): ``mean/max_abs_logprob_diff``, ``mean/max_abs_prob_diff``, ``k3`` and
    ``pearson`` (None when undefined: no positions, or a constant sequence)."""
    d = lb - la
    if not d.size:
        return {
            "mean_abs_logprob_diff": None,
            "max_abs_logprob_diff": None,
            "mean_abs_prob_diff": None,
            "max_abs_prob_diff": None,
            "k3": None,
            "pearson": None,
        }
    dp = np.abs(np.exp(lb) - np.exp(la))
    # exp(d) - 1 - d loses every digit for tiny d: expm1 keeps them; beyond float range it is inf
    with np.errstate(over="ignore"):
        k3 = np.expm1(d) - d
    pearson = None
    if d.size >= 2:  # scaled first: squares of logprobs beyond 1e154 overflow (the correlation is the same)
        sa, sb = (x / top if (top := np.abs(x).max()) > 0 else x for x in (la, lb))
        if np.std(sa) > 0 and np.std(sb) > 0:
            pearson = _num(np.corrcoef(sa, sb)[0, 1])
    return {
        "mean_abs_logprob_diff": _num(np.abs(d).mean()),
        "max_abs_logprob_diff": _num(np.abs(d).max()),
        "mean_abs_prob_diff": _num(dp.mean()),
        "max_abs_prob_diff": _num(dp.max()),
        "k3": _num(k3.mean()),
        "pearson": pearson,
    }


def gate_failures(report: dict[str, Any], measure: str, limit: float) -> list[str]:
    """The requests of a :func:`compare_results` report that fail the gate ``measure <= limit``,
    each as ``"id (why)"``: the value above ``limit``, the value missing (no compared position,
    or not finite), or any compared logprob not finite (the measure then covers only part of the
    request). A gate never passes a request it cannot measure. ``ValueError`` for a
    ``measure`` not in :data:`GATED_MEASURES`."""
    if measure not in GATED_MEASURES:
        raise ValueError(f"measure must be one of {', '.join(GATED_MEASURES)} (got {measure!r})")
    failed = []
    for r in report["requests"]:
        value, bad = r[measure], r.get("non_finite_logprobs", 0)
        if bad:
            failed.append(f"{r['id']} ({bad} non-finite logprobs)")
        elif value is None:
            why = "not finite" if r["compared_positions"] else "no compared position"
            failed.append(f"{r['id']} ({measure} missing: {why})")
        elif value > limit:
            failed.append(f"{r['id']} ({value:.3g})")
    return failed


def compare_results(
    requests: Sequence[TraceRequest],
    a: Sequence[RequestResult],
    b: Sequence[RequestResult],
    *,
    names: Sequence[str] = ("torch", "jax"),
) -> dict[str, Any]:
    """The comparison report of runs ``a`` and ``b`` of ``requests`` (results in request order).

    Returns ``{"summary": ..., "per_position": [...], "requests": [...]}``: per request its
    comparable positions, ``logprob_diff`` (``b - a``, float64 of the float32 values),
    ``first_argmax_divergence`` / ``first_token_divergence`` (position or ``None``); per
    position over all requests the count, max and mean of ``|logprob_diff|``; and summary
    statistics (max, mean, p50, p99, RMS of ``|logprob_diff|``, counts), and per request and in
    the summary the measures of :func:`mismatch_measures`, ``argmax_mismatches`` and
    ``first_divergence`` (argmax and ranks only where both runs have them: a rollout's are
    unknown, -1; ``argmax_compared`` and ``ranks_compared`` say whether they were);
    ``rl_metrics``: per request and over the batch the measures RL stacks log
    (:func:`trace_replay_app.metrics.rl_metrics`, ``b`` in the trainer's role and ``a`` in the
    rollout's, over the compared positions with finite logprobs). Non-finite values are written
    as ``None``.
    """
    name_a, name_b = names
    rows: list[dict[str, Any]] = []
    by_position: dict[int, list[float]] = {}
    all_diffs: list[np.ndarray] = []
    pairs_a: list[np.ndarray] = []
    pairs_b: list[np.ndarray] = []
    rank_changes = argmax_mismatches = 0
    argmax_known = ranks_known = True
    for req, ra, rb in zip(requests, a, b, strict=True):
        if not (ra.id == rb.id == req.id):
            raise ValueError(f"results out of order: request {req.id!r} got results {ra.id!r} and {rb.id!r}")
        n = min(len(ra.tokens), len(rb.tokens))
        ta, tb = np.asarray(ra.tokens[:n]), np.asarray(rb.tokens[:n])
        token_div = _first(ta != tb)
        if len(ra.tokens) != len(rb.tokens) and token_div is None:
            token_div = n
        m = n if token_div is None else min(n, token_div + 1)  # the diverging position itself still compares
        la = np.asarray(ra.logprobs[:m], dtype=np.float64)
        lb = np.asarray(rb.logprobs[:m], dtype=np.float64)
        diff = lb - la
        valid = np.ones(m, dtype=bool)
        if token_div is not None and token_div < m:
            valid[token_div:] = False  # different tokens: their logprobs are not the same quantity
            diff[token_div:] = np.nan
        am_a, am_b = np.asarray(ra.argmax[:m]), np.asarray(rb.argmax[:m])
        known = bool((am_a >= 0).all() and (am_b >= 0).all())  # a rollout has no greedy tokens (-1)
        argmax_div = _first(am_a != am_b) if known else None
        ranks_a, ranks_b = np.asarray(ra.ranks[:m]), np.asarray(rb.ranks[:m])
        both = valid & (ranks_a >= 0) & (ranks_b >= 0)
        rank_changes += int(np.sum(ranks_a[both] != ranks_b[both]))
        ranks_known &= bool(both[valid].all())  # a rollout has no ranks (-1)
        absd = np.abs(diff[valid])
        all_diffs.append(absd)
        ok = valid & np.isfinite(la) & np.isfinite(lb)
        non_finite = int(np.sum(valid & ~ok))
        pairs_a.append(la[ok])
        pairs_b.append(lb[ok])
        mismatched = int(np.sum(am_a != am_b)) if known else 0
        argmax_known &= known
        argmax_mismatches += mismatched
        firsts = [p for p in (argmax_div, token_div) if p is not None]
        for pos in np.flatnonzero(valid):
            by_position.setdefault(int(pos), []).append(float(abs(diff[pos])))
        rows.append(
            {
                "id": req.id,
                "traced": req.trace is not None,
                "tokens": [int(t) for t in ta],
                "compared_positions": int(valid.sum()),
                "non_finite_logprobs": non_finite,
                "first_token_divergence": token_div,
                "first_argmax_divergence": argmax_div,
                **mismatch_measures(la[ok], lb[ok]),
                "argmax_mismatches": mismatched,
                "first_divergence": min(firsts) if firsts else None,
                "logprob_diff": [_num(d) for d in diff],
                f"{name_a}_logprobs": [_num(x) for x in la],
                f"{name_b}_logprobs": [_num(x) for x in lb],
                f"{name_a}_argmax": [int(x) for x in ra.argmax[:m]],
                f"{name_b}_argmax": [int(x) for x in rb.argmax[:m]],
            }
        )
    flat = np.concatenate(all_diffs) if all_diffs else np.zeros(0)
    finite = flat[np.isfinite(flat)]
    argmax_divs = [r["first_argmax_divergence"] for r in rows if r["first_argmax_divergence"] is not None]
    token_divs = [r for r in rows if r["first_token_divergence"] is not None]
    traced_divs = sum(r["traced"] for r in token_divs)  # a trace not reproduced, or given differently

    def stat(f) -> float | None:
        return _num(f(finite)) if finite.size else None

    rl = rl_metrics(train=pairs_b, rollout=pairs_a)
    for row, values in zip(rows, rl.per_request, strict=True):
        row["rl_metrics"] = values
    overall = mismatch_measures(
        np.concatenate(pairs_a) if pairs_a else np.zeros(0), np.concatenate(pairs_b) if pairs_b else np.zeros(0)
    )
    first_divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    summary = {
        "frameworks": [name_a, name_b],
        "requests": len(rows),
        "traced_requests": sum(r["traced"] for r in rows),
        "compared_positions": int(flat.size),
        "non_finite_differences": int(flat.size - finite.size),
        "requests_with_non_finite_logprobs": [r["id"] for r in rows if r["non_finite_logprobs"]],
        "max_abs_logprob_diff": stat(np.max),
        "mean_abs_logprob_diff": stat(np.mean),
        "p50_abs_logprob_diff": stat(lambda x: np.percentile(x, 50)),
        "p99_abs_logprob_diff": stat(lambda x: np.percentile(x, 99)),
        "rms_logprob_diff": stat(_rms),
        "mean_abs_prob_diff": overall["mean_abs_prob_diff"],
        "max_abs_prob_diff": overall["max_abs_prob_diff"],
        "k3": overall["k3"],
        "pearson": overall["pearson"],
        "argmax_mismatches": argmax_mismatches,
        "argmax_compared": argmax_known,
        "first_divergence": min(first_divs) if first_divs else None,
        "rank_changes": rank_changes,
        "ranks_compared": ranks_known,
        "requests_with_argmax_divergence": len(argmax_divs),
        "earliest_argmax_divergence": min(argmax_divs) if argmax_divs else None,
        "untraced_requests_with_token_divergence": len(token_divs) - traced_divs,
        "traced_requests_with_token_divergence": traced_divs,
        "rl_metrics": rl.batch,
    }
    per_position = [
        {
            "position": p,
            "n": len(v),
            "max_abs_logprob_diff": _num(max(v)),
            "mean_abs_logprob_diff": _num(sum(v) / len(v)),
        }
        for p, v in sorted(by_position.items())
    ]
    return {"summary": summary, "per_position": per_position, "requests": rows}


def output_paths(
    out_dir_option: str | None,
    report: str | None,
    plot: str | None,
    inputs: Sequence[tuple[str, str | None]],
    checkpoint: str | None,
) -> tuple[str, str, str | None]:
    """``compare``'s ``(report path, plot path, folder to create or None)`` from its options;
    :class:`~trace_replay_app.runner.CliError` for options that exclude each other (``--out-dir``
    with ``--report``/``--plot``) and outputs that would replace an input (``(option, path)``
    pairs) or each other."""
    if out_dir_option is not None and (report or plot):
        given = " and ".join(o for o, v in (("--report", report), ("--plot", plot)) if v)
        raise CliError(f"--out-dir {out_dir_option}: give --out-dir or {given}, not both")
    out_dir = out_dir_option or "."
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CliError(f"--out-dir {out_dir}: exists and is not a folder")
    report = report or os.path.join(out_dir, "compare_report.json")
    plot = plot or os.path.join(out_dir, "compare_divergence.png")
    create = out_dir if not os.path.isdir(out_dir) else None  # made once the work is done: holds no input
    if create is None:
        check_outputs([("--report", report), ("--plot", plot)], inputs, checkpoint)
    return report, plot, create


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A few readable lines of a :func:`compare_results` report."""
    s = report["summary"]
    a, b = s["frameworks"]

    def g(x):
        return "n/a" if x is None else f"{x:.3g}"

    # a rollout records neither ranks nor greedy tokens: say so, never "0 differ"
    ranks = f"ranks differ at {s['rank_changes']} positions" if s["ranks_compared"] else "ranks not compared"
    argmax = f"argmax differs at {s['argmax_mismatches']} positions" if s["argmax_compared"] else "argmax not compared"
    lines = [
        (
            f"{a} vs {b}: {s['requests']} requests ({s['traced_requests']} traced), "
            f"{s['compared_positions']} positions compared"
        ),
        (
            f"|logprob difference|: max {g(s['max_abs_logprob_diff'])}, mean {g(s['mean_abs_logprob_diff'])}, "
            f"p50 {g(s['p50_abs_logprob_diff'])}, p99 {g(s['p99_abs_logprob_diff'])}, "
            f"rms {g(s['rms_logprob_diff'])}; {ranks}"
        ),
        (
            f"|probability difference|: max {g(s['max_abs_prob_diff'])}, mean {g(s['mean_abs_prob_diff'])}; "
            f"k3 KL estimate {g(s['k3'])}; logprob correlation {g(s['pearson'])}; {argmax}"
        ),
    ]
    if s["argmax_compared"] and s["requests_with_argmax_divergence"]:
        first = [
            (r["first_argmax_divergence"], r["id"])
            for r in report["requests"]
            if r["first_argmax_divergence"] is not None
        ]
        pos, rid = min(first)
        lines.append(
            f"argmax choices differ in {s['requests_with_argmax_divergence']} requests; "
            f"earliest at position {pos} (request {rid})"
        )
    elif s["argmax_compared"]:
        lines.append("argmax choices agree at every compared position")
    if s["untraced_requests_with_token_divergence"]:
        lines.append(
            f"{s['untraced_requests_with_token_divergence']} untraced requests decoded different tokens "
            "(compared up to that position)"
        )
    if s["traced_requests_with_token_divergence"]:
        lines.append(
            f"{s['traced_requests_with_token_divergence']} traced requests hold different tokens "
            "(compared up to that position)"
        )
    if s["non_finite_differences"]:
        lines.append(f"{s['non_finite_differences']} positions had a non-finite logprob difference")
    return lines


def batch_gate_failures(report: dict[str, Any], metric: str, limit: float) -> list[str]:
    """The pairs of a :func:`compare_sources` report whose batch value of the RL measure
    ``metric`` (a key of ``rl_metrics``) is above ``limit`` or missing, each as
    ``"a vs b (why)"``; ``ValueError`` for an unknown key."""
    failed = []
    for pair in pair_reports(report):
        values = pair["summary"]["rl_metrics"]
        if metric not in values:
            raise ValueError(f"metric must be one of {', '.join(GATED_MEASURES)} or an rl_metrics key (got {metric!r})")
        value = values[metric]
        a, b = pair["summary"]["frameworks"]
        if value is None:
            failed.append(f"{a} vs {b} ({metric} missing)")
        elif value > limit:
            failed.append(f"{a} vs {b} ({metric} {value:.3g})")
    return failed


def pair_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair's report of a :func:`compare_sources` report, the first one first."""
    return [report, *report.get("pairs", [])]


def compare_sources(requests: Sequence[TraceRequest], sources: Sequence[Any]) -> dict[str, Any]:
    """The first of ``sources`` (:class:`~trace_replay_app.sources.Source`) against each of the
    others over ``requests`` (in their order): the first pair's :func:`compare_results` report at
    the top level, the others' under ``pairs``, and ``sources`` (name, view, file).
    ``ValueError`` naming the source and the request when a source lacks one of ``requests``."""
    if len(sources) < 2:
        raise ValueError(f"compare needs at least two sources (got {len(sources)})")

    def results(source) -> list[RequestResult]:
        missing = [r.id for r in requests if r.id not in source.results]
        if missing:
            raise ValueError(f"source {source.name} has no result for request {missing[0]!r}")
        return [source.results[r.id] for r in requests]

    ref = results(sources[0])
    reports = [compare_results(requests, ref, results(s), names=(sources[0].name, s.name)) for s in sources[1:]]
    first = reports[0]
    first["sources"] = [{"name": s.name, "view": s.view, "path": s.path} for s in sources]
    first["pairs"] = reports[1:]
    return first
