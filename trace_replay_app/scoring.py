"""Teacher-forced scoring, the trainer's view (numpy only; each framework's forward runs it).

A trainer scores a completion it already has in one forward pass over prompt + completion: the
logits at position ``i`` give the distribution of the token at ``i + 1``, so completion token
``j`` (at position ``len(prompt) + j``) is scored from the logits of position
``len(prompt) + j - 1``. No KV cache, no decode steps; the numerics are those of a prefill over
the whole sequence (other kernels, other rounding than decode with replay: the gap between the
two is one of the things ``compare`` measures).

:func:`plan_score` checks a call and cuts the requests into batches of at most ``max_tokens``
padded tokens (right padding: under causal attention padding changes no earlier position). Each
:class:`ScoreBatch` holds the token matrix, the flat indices of the rows whose logits are needed
and their target tokens; a framework's ``run_score`` computes the hidden states of a batch, then
the output projection and the logprob op chunk by chunk over those rows (the full
``[tokens, vocab]`` logits never exist at once), and :func:`score_results` returns one
:class:`~trace_replay_app.records.RequestResult` per request (every token ``forced``), the
records ``run`` writes, so every consumer of ``run``'s output reads ``score``'s too.

The contract of every family's ``run_score`` (both frameworks)::

    run_score(config, weights, requests, *, device="cpu", dtype="float32", max_tokens=16384,
              chunk_rows=2048, logprobs_mode="raw_logprobs", temperature=1.0, top_k=0)
        -> list[RequestResult]

(torch adds ``compile=``: the forward through ``torch.compile``, by default on CUDA.)

Every request must carry a trace (the completion to score). Logprobs, ranks and the entropy of
each position's distribution are those of the raw logits (no temperature), float32, from one
read of them (the logprob op); with ``logprobs_mode="processed_logprobs"``, those of
``logits / temperature`` (vLLM's processed logprobs, no top-k or top-p); ``argmax`` is the
model's greedy token at each position. With ``top_k > 0`` each position also carries the ``top_k``
most likely tokens and their logprobs, from the same read of the logits (ties: the lower id
first).
A rejected call raises ``TypeError``/``ValueError`` naming the argument before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trace_replay_core import TOPK_MAX

from .records import RequestResult, TraceRequest
from .schedule import check_device, check_logprobs_mode, check_sampling

__all__ = ["ScoreBatch", "ScorePlan", "plan_score", "score_results", "PAD_MULTIPLE"]

PAD_MULTIPLE = 16  # padded lengths are multiples of this: fewer distinct shapes to compile


@dataclasses.dataclass(frozen=True)
class ScoreBatch:
    """Requests ``members`` (indices into the call's requests) as one ``tokens`` matrix
    ``[len(members), n]`` (int64, right-padded with 0); ``rows``: the flat indices
    (``request * n + position``) of the positions whose logits score a completion token, request
    by request in order; ``targets``: those tokens (int64); ``counts``: tokens per member."""

    members: tuple[int, ...]
    tokens: np.ndarray
    rows: np.ndarray
    targets: np.ndarray
    counts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ScorePlan:
    """The batches of a checked call, its compute ``dtype``, ``chunk_rows``, the temperature
    the logprobs are taken at (``None``: the raw logits) and ``top_k`` (0: none)."""

    batches: tuple[ScoreBatch, ...]
    dtype: str
    chunk_rows: int
    logprob_temperature: float | None = None
    top_k: int = 0


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (got {value})")
    return int(value)


def plan_score(
    config: Any,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    device: Any,
    dtype: Any,
    max_tokens: Any,
    chunk_rows: Any,
    config_type: type,
    check_weights: Any,
    logprobs_mode: Any = "raw_logprobs",
    temperature: Any = 1.0,
    top_k: Any = 0,
) -> ScorePlan:
    """Check a ``run_score`` call (host-only) and cut its requests, in order, into batches of at
    most ``max_tokens`` padded tokens (a request longer than that is a batch of its own)."""
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__} (got {type(config).__name__})")
    check_weights(config, weights)
    n_positions, vocab = int(getattr(config, "n_positions")), int(getattr(config, "vocab_size"))  # noqa: B009
    check_device(device)
    temperature = check_sampling(dtype, temperature, 0)
    processed = check_logprobs_mode(logprobs_mode) == "processed_logprobs"
    if processed and temperature <= 0:
        raise ValueError(f"temperature must be above 0 for logprobs_mode='processed_logprobs' (got {temperature})")
    max_tokens = _positive_int("max_tokens", max_tokens)
    chunk_rows = _positive_int("chunk_rows", chunk_rows)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int (got {type(top_k).__name__} {top_k!r})")
    if not 0 <= top_k <= min(TOPK_MAX, vocab):
        limit = min(TOPK_MAX, vocab)
        raise ValueError(f"top_k must be between 0 and {limit} (the op's limit and the vocabulary) (got {top_k})")
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of TraceRequest (got {type(requests).__name__})")
    lengths = []
    for i, r in enumerate(requests):
        if not isinstance(r, TraceRequest):
            raise TypeError(f"requests[{i}] must be a TraceRequest (got {type(r).__name__})")
        if r.trace is None:
            raise ValueError(f"requests[{i}] ({r.id!r}) has no trace: score needs the completion tokens to score")
        total = len(r.prompt) + len(r.trace)
        if total > n_positions:
            raise ValueError(f"requests[{i}] ({r.id!r}) holds {total} tokens, more than the model's {n_positions=}")
        bad = [t for t in (*r.prompt, *r.trace) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"requests[{i}] ({r.id!r}) holds token {bad[0]}, outside [0, {vocab})")
        lengths.append(total)
    batches: list[ScoreBatch] = []
    group: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        padded = -(-max(longest, n) // PAD_MULTIPLE) * PAD_MULTIPLE
        if group and padded * (len(group) + 1) > max_tokens:
            batches.append(_batch(requests, group))
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        batches.append(_batch(requests, group))
    return ScorePlan(tuple(batches), dtype, chunk_rows, temperature if processed else None, int(top_k))


def _batch(requests: Sequence[TraceRequest], members: list[int]) -> ScoreBatch:
    seqs = [(*requests[i].prompt, *(requests[i].trace or ())) for i in members]
    n = -(-max(len(s) for s in seqs) // PAD_MULTIPLE) * PAD_MULTIPLE
    tokens = np.zeros((len(members), n), np.int64)
    rows, targets, counts = [], [], []
    for k, (i, seq) in enumerate(zip(members, seqs)):
        tokens[k, : len(seq)] = seq
        p, m = len(requests[i].prompt), len(requests[i].trace or ())
        rows.append(k * n + np.arange(p - 1, p + m - 1))
        targets.append(np.asarray(requests[i].trace, np.int64))
        counts.append(m)
    return ScoreBatch(tuple(members), tokens, np.concatenate(rows), np.concatenate(targets), tuple(counts))


def score_results(
    requests: Sequence[TraceRequest], plan: ScorePlan, outputs: Sequence[tuple[np.ndarray, ...]]
) -> list[RequestResult]:
    """One result per request in request order from each batch's ``(logprobs, ranks, argmax,
    entropy)`` over its ``rows``, followed by ``(topk_logprobs, topk_ids)`` ``[rows, top_k]``
    when ``plan.top_k``."""
    results: list[RequestResult | None] = [None] * len(requests)
    for batch, (lp, rk, am, ent, *topk) in zip(plan.batches, outputs, strict=True):
        at = 0
        for i, m in zip(batch.members, batch.counts):
            r = requests[i]
            results[i] = RequestResult(
                id=r.id,
                tokens=np.asarray(r.trace, np.int64),
                forced=np.ones(m, bool),
                logprobs=np.asarray(lp[at : at + m], np.float32),
                ranks=np.asarray(rk[at : at + m], np.int64),
                argmax=np.asarray(am[at : at + m], np.int64),
                entropy=np.asarray(ent[at : at + m], np.float32),
                topk_logprobs=np.asarray(topk[0][at : at + m], np.float32) if topk else None,
                topk_ids=np.asarray(topk[1][at : at + m], np.int64) if topk else None,
            )
            at += m
    return [r for r in results if r is not None]
