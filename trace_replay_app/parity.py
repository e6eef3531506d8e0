"""Parity tests for a user's own models: the same requests through a PyTorch model and its JAX
port, on this project's decode drivers, and an assertion with tolerances bound to the dtype.

Example (a torch model keeping :class:`~trace_replay_app.drivers.torch_driver.TorchDecodeModel`,
a JAX port keeping :class:`~trace_replay_app.drivers.jax_driver.JaxDecodeModel` with its
parameters; ``examples/parity/`` has a runnable one)::

    from trace_replay_app import TraceRequest
    from trace_replay_app.parity import assert_parity, run_parity

    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)), TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    run = run_parity(torch_model, jax_model, jax_params, requests)
    assert_parity(run.a, run.b, requests=run.requests, dtype="float32")

Traced requests force both runs onto the same tokens, so their logprobs compare at every
position; untraced ones decode greedily in each framework and compare while their tokens
agree. :func:`assert_parity` fails with :class:`ParityError`, a readable message (each failing
request, its first divergent position, the largest differences and the mismatch measures)
that carries the full report of :func:`trace_replay_app.compare.compare_results`.

Importing this module imports neither torch nor JAX: :func:`run_parity` imports the drivers
when it is called.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .compare import compare_results
from .records import RequestResult, TraceRequest

__all__ = ["Tolerance", "TOLERANCES", "ParityRun", "ParityError", "run_parity", "assert_parity", "tolerance_for"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far two runs' logprobs of the same tokens may be apart. ``max_abs``: the most
    ``|d|`` at one position (``d``: second run's logprob minus the first's); ``mean_abs``: the
    most mean ``|d|`` over every compared position of every request (``None``: not bounded);
    ``measured``: the measurement the figures come from, in words."""

    max_abs: float
    mean_abs: float | None
    measured: str


# float32: the reference loops' bounds. GPT-2 (tests/helpers/gpt2_cases.py, LOGPROB_ATOL 5e-5)
# against a float64 forward: at most ~7e-7 with its seeded weights and ~5e-6 with weights that
# give logits ~2, both frameworks, CPU; torch vs JAX 9.5e-7 at most (README, `compare`). The
# Llama family's loops agree with transformers and with each other within 1e-5 (tests/
# test_llama_loops.py), on the GPU too (tests/test_gpu_score.py). A modelling error moves
# logprobs by 4e-3 to 0.6 (a dropped bias, an off-by-one position).
# bfloat16: tests/helpers/bf16_bounds.py LLAMA_BF16, the looser of its two measured bounds: torch
# vs JAX and bf16 vs float32 noise, CPU, seeds 0-3, mean |d| <= 9.2e-3, max <= 2.8e-2 over 40-130
# positions; the smallest planted error it catches moves the mean by 3.8e-2 (rotary base 1e4
# instead of 1e6: 8.5e-2). The mean needs tens of positions to tell noise from an error. Both
# were measured on models whose logits are of order 1; bfloat16 rounds a logit of size L by up to
# L * 2**-9, so a model with larger logits needs a wider bound (pass tolerance=).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(
        max_abs=5e-5,
        mean_abs=None,
        measured="the reference loops, float32: |d| <= 5e-6 against float64 (GPT-2), <= 1e-5 torch vs JAX "
        "and against transformers (Llama family)",
    ),
    "bfloat16": Tolerance(
        max_abs=5e-2,
        mean_abs=1.5e-2,
        measured="tests/helpers/bf16_bounds.py LLAMA_BF16, logits of order 1: bf16 noise mean |d| <= 9.2e-3, "
        "max <= 2.8e-2 (CPU, seeds 0-3); the smallest planted error caught moves the mean by 3.8e-2",
    ),
}


def tolerance_for(dtype: Any) -> Tolerance:
    """The default :class:`Tolerance` of a compute ``dtype``: ``"float32"`` or ``"bfloat16"``
    (a string, or a torch, numpy or JAX dtype of that name); ``ValueError`` otherwise."""
    name = _dtype_name(dtype)
    if name not in TOLERANCES:
        raise ValueError(f"dtype must be one of {', '.join(TOLERANCES)} or pass tolerance= (got {dtype!r})")
    return TOLERANCES[name]


def _dtype_name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype)).removeprefix("torch.")


class ParityError(AssertionError):
    """Two runs disagree beyond a :class:`Tolerance`. ``str()`` is the readable message;
    ``parity_report`` the :func:`~trace_replay_app.compare.compare_results` report of the two
    runs, ``failures`` one dict per failing request (``id``, ``first_divergent_position``,
    ``why``), ``tolerance`` the bound that was applied."""

    def __init__(self, message: str, *, report: dict[str, Any], failures: list[dict[str, Any]], tolerance: Tolerance):
        super().__init__(message)
        self.parity_report, self.failures, self.tolerance = report, failures, tolerance


@dataclasses.dataclass(frozen=True)
class ParityRun:
    """What :func:`run_parity` returns: the ``requests``, the results of the torch model
    (``a``) and of the JAX model (``b``), one per request in request order, and ``report``,
    the :func:`~trace_replay_app.compare.compare_results` report of the two (``d = b - a``)."""

    requests: tuple[TraceRequest, ...]
    a: list[RequestResult]
    b: list[RequestResult]
    report: dict[str, Any]


def run_parity(
    torch_model: Any,
    jax_model: Any,
    jax_params: Any,
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    prefill_tokens: int = 16384,
    cuda_graph: bool | None = None,
    names: tuple[str, str] = ("torch", "jax"),
) -> ParityRun:
    """Decode ``requests`` through ``torch_model`` (:func:`~trace_replay_app.drivers.torch_driver.decode_model`)
    and through ``jax_model`` with ``jax_params``
    (:func:`~trace_replay_app.drivers.jax_driver.decode_model`), both on ``device``, greedily
    (traced requests forced onto their traces), and compare them.

    ``max_batch``, ``prefill_tokens`` and ``cuda_graph`` go to the drivers (the JAX driver
    prefills one prompt at a time). ``names``: the two runs' names in the report. Host-blocking:
    returns once both runs are on the host. Arguments are checked by the drivers
    (``TypeError``/``ValueError`` naming them) before a run starts."""
    from .drivers import jax_driver, torch_driver

    requests = tuple(requests)
    a = torch_driver.decode_model(
        torch_model, requests, device=device, max_batch=max_batch, prefill_tokens=prefill_tokens, cuda_graph=cuda_graph
    )
    b = jax_driver.decode_model(jax_model, jax_params, requests, device=device, max_batch=max_batch)
    return ParityRun(requests, a, b, compare_results(requests, a, b, names=names))


def assert_parity(
    a: Sequence[RequestResult],
    b: Sequence[RequestResult],
    *,
    dtype: Any,
    requests: Sequence[TraceRequest] | None = None,
    tolerance: Tolerance | None = None,
    names: tuple[str, str] = ("torch", "jax"),
) -> dict[str, Any]:
    """Fail unless runs ``a`` and ``b`` of the same requests agree within the tolerance of the
    compute ``dtype`` (:data:`TOLERANCES`, or ``tolerance``); return the comparison report
    (:func:`~trace_replay_app.compare.compare_results`, ``d = b - a``).

    A request fails when: its results differ in id or length; a traced request's tokens
    differ; an untraced request's tokens part at a position where the two runs' logprobs of
    their own choices differ by more than ``max_abs`` (within it, the two top logits nearly
    tie and either choice is right: positions from there on are not compared); a compared
    logprob is not finite; or ``|d| > max_abs`` at a compared position. The runs fail
    together when the mean ``|d|`` over every compared position exceeds ``mean_abs``. Its
    first divergent position is the first position (0: the first token after the prompt;
    with ``requests``, its index in prompt + completion too) where any of these holds.

    ``requests``: the requests the runs decoded (for their prompts and traces); without
    them, a request counts as traced when its results are ``forced``. Raises
    :class:`ParityError` (an ``AssertionError``) with a message naming each failing request
    (the first few), its first divergent position, both logprobs there and how many of its
    positions are beyond the bound, the runs' largest differences (request and position) and
    the mismatch measures. Host-only."""
    tol = tolerance if tolerance is not None else tolerance_for(dtype)
    if requests is None:
        requests = [_request_of(x) for x in a]
    report = compare_results(requests, a, b, names=names)
    failures, diffs = [], []
    for req, x, y in zip(requests, a, b, strict=True):
        failure, d = _check_request(req, x, y, tol, names)
        diffs.append(d)
        if failure is not None:
            failures.append(failure)
    flat = np.concatenate([np.abs(d[np.isfinite(d)]) for d in diffs]) if diffs else np.zeros(0)
    mean = float(flat.mean()) if flat.size else 0.0
    mean_failed = tol.mean_abs is not None and mean > tol.mean_abs
    if mean_failed and not failures:
        failures = [f for f in (_above_mean(r, d, tol) for r, d in zip(requests, diffs)) if f is not None]
    if failures or mean_failed:
        message = _message(requests, diffs, failures, report, tol, dtype, names, mean, mean_failed)
        raise ParityError(message, report=report, failures=failures, tolerance=tol)
    return report


def _request_of(result: RequestResult) -> TraceRequest:
    """A stand-in request for a result: traced (its own tokens) when forced."""
    tokens = tuple(int(t) for t in result.tokens)
    forced = bool(np.asarray(result.forced).any())
    return TraceRequest(result.id, (), tokens if forced else None, 0 if forced else len(tokens))


def _check_request(req: TraceRequest, x: RequestResult, y: RequestResult, tol: Tolerance, names):
    """``(failure or None, d)`` of one request: ``d`` at its compared positions (NaN where a
    logprob is not finite)."""
    na, nb = names
    la, lb = np.asarray(x.logprobs, np.float64), np.asarray(y.logprobs, np.float64)
    if not x.id == y.id == req.id:
        raise ValueError(f"results out of order: request {req.id!r} got results {x.id!r} and {y.id!r}")
    found: list[tuple[int, str]] = []
    n = min(len(x.tokens), len(y.tokens))
    if len(x.tokens) != len(y.tokens):
        found.append((n, f"{na} decoded {len(x.tokens)} tokens, {nb} {len(y.tokens)}"))
    parted = np.flatnonzero(np.asarray(x.tokens[:n]) != np.asarray(y.tokens[:n]))
    if parted.size:
        j = int(parted[0])
        tie = math.isfinite(la[j] - lb[j]) and abs(la[j] - lb[j]) <= tol.max_abs
        if req.trace is not None or not tie:
            kind = "forced tokens differ" if req.trace is not None else "tokens part without a near-tie"
            found.append((j, f"{kind}: {na} {int(x.tokens[j])} ({la[j]:.6g}), {nb} {int(y.tokens[j])} ({lb[j]:.6g})"))
        n = j
    d = lb[:n] - la[:n]
    bad = np.flatnonzero(~np.isfinite(d))
    if bad.size:
        j = int(bad[0])
        found.append((j, f"logprob not finite: {na} {la[j]:.6g}, {nb} {lb[j]:.6g}"))
    over = np.flatnonzero(np.abs(np.nan_to_num(d, nan=0.0)) > tol.max_abs)
    if over.size:
        j = int(over[0])
        found.append((j, f"|d| {abs(d[j]):.3g} > {tol.max_abs:.3g}: {na} {la[j]:.6g}, {nb} {lb[j]:.6g}"))
    if not found:
        return None, d
    j, why = min(found)
    return {"id": req.id, "first_divergent_position": j, "why": why, "positions_beyond": int(over.size)}, d


def _above_mean(req: TraceRequest, d: np.ndarray, tol: Tolerance):
    """The mean bound failed alone: a request whose own mean ``|d|`` exceeds it, with its
    first position above it."""
    assert tol.mean_abs is not None
    absd = np.abs(d)
    if not absd.size or absd.mean() <= tol.mean_abs:
        return None
    j = int(np.flatnonzero(absd > tol.mean_abs)[0])
    return {
        "id": req.id,
        "first_divergent_position": j,
        "why": f"mean |d| {absd.mean():.3g} > {tol.mean_abs:.3g}; |d| {absd[j]:.3g} at this position",
        "positions_beyond": 0,
    }


_SHOWN = 6  # failing requests and largest differences spelled out in a message


def _message(requests, diffs, failures, report, tol: Tolerance, dtype, names, mean: float, mean_failed: bool) -> str:
    na, nb = names
    bound = f"|d| <= {tol.max_abs:.3g} per position" + (
        f", mean |d| <= {tol.mean_abs:.3g}" if tol.mean_abs is not None else ""
    )
    lines = [f"{na} and {nb} disagree beyond the {_dtype_name(dtype)} tolerance ({bound}; {tol.measured})"]
    if mean_failed:
        lines.append(f"mean |d| {mean:.3g} over all compared positions exceeds {tol.mean_abs:.3g}")
    by_id = {r.id: r for r in requests}
    for f in failures[:_SHOWN]:
        req = by_id[f["id"]]
        traced = "traced" if req.trace is not None else "untraced"
        where = f"position {f['first_divergent_position']}"
        if req.prompt:
            where += f" (sequence index {len(req.prompt) + f['first_divergent_position']})"
            traced += f", prompt of {len(req.prompt)} token{'s' if len(req.prompt) > 1 else ''}"
        extra = f"; {f['positions_beyond']} positions beyond {tol.max_abs:.3g}" if f["positions_beyond"] else ""
        lines.append(f"  request {f['id']!r} ({traced}): first divergent {where}: {f['why']}{extra}")
    if len(failures) > _SHOWN:
        lines.append(f"  ... and {len(failures) - _SHOWN} more requests")
    top = sorted(
        ((abs(float(v)), req.id, j) for req, d in zip(requests, diffs) for j, v in enumerate(d) if math.isfinite(v)),
        reverse=True,
    )[:_SHOWN]
    if top:
        lines.append("largest |d|: " + ", ".join(f"{v:.3g} (request {rid!r}, position {j})" for v, rid, j in top))
    s = report["summary"]

    def g(key):
        return "n/a" if s[key] is None else f"{s[key]:.3g}"

    lines.append(
        f"measures over {s['compared_positions']} compared positions of {s['requests']} requests: "
        f"max |d| {g('max_abs_logprob_diff')}, mean {g('mean_abs_logprob_diff')}, p99 {g('p99_abs_logprob_diff')}; "
        f"max |probability difference| {g('max_abs_prob_diff')}; k3 {g('k3')}; pearson {g('pearson')}; "
        f"argmax differs at {s['argmax_mismatches']} positions; ranks differ at {s['rank_changes']}"
    )
    return "\n".join(lines)
