"""The results of :func:`~trace_replay_jax.token_logprob_rank`: four named tuples (pytrees),
one per combination of ``top_k > 0`` and ``argmax=True``, shared by both methods.

Fields are new JAX arrays: ``logprobs`` float32 ``[batch]``, ``ranks`` int32 ``[batch]``,
``topk_logprobs`` float32 and ``topk_ids`` int32 ``[batch, top_k]``, ``argmax`` int32 ``[batch]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax

__all__ = [
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobResult",
    "named_result",
]


class LogprobRank(NamedTuple):
    """``token_logprob_rank``'s result without top-k (a pytree): unpacks as ``logprobs, ranks``."""

    logprobs: jax.Array
    ranks: jax.Array


class LogprobRankTopK(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0`` (a pytree):
    ``logprobs, ranks, topk_logprobs, topk_ids``."""

    logprobs: jax.Array
    ranks: jax.Array
    topk_logprobs: jax.Array
    topk_ids: jax.Array


class LogprobRankArgmax(NamedTuple):
    """``token_logprob_rank``'s result with ``argmax=True`` and no top-k (a pytree):
    ``logprobs, ranks, argmax`` (``argmax``: int32 ``[batch]``, each row's greedy token)."""

    logprobs: jax.Array
    ranks: jax.Array
    argmax: jax.Array


class LogprobRankTopKArgmax(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0`` and ``argmax=True`` (a pytree):
    ``logprobs, ranks, topk_logprobs, topk_ids, argmax``."""

    logprobs: jax.Array
    ranks: jax.Array
    topk_logprobs: jax.Array
    topk_ids: jax.Array
    argmax: jax.Array


LogprobResult = LogprobRank | LogprobRankTopK | LogprobRankArgmax | LogprobRankTopKArgmax


def named_result(fields: Sequence[jax.Array], top_k: int, argmax: bool) -> LogprobResult:
    """The named result for ``(logprobs, ranks[, topk_logprobs, topk_ids][, argmax])``."""
    if top_k:
        return LogprobRankTopKArgmax(*fields) if argmax else LogprobRankTopK(*fields)
    return LogprobRankArgmax(*fields) if argmax else LogprobRank(*fields)
