"""The results of :func:`~trace_replay_jax.token_logprob_rank`: eight named tuples (pytrees),
one per combination of ``top_k > 0``, ``argmax=True`` and ``entropy=True``, shared by both methods.

Fields are new JAX arrays: ``logprobs`` float32 ``[batch]``, ``ranks`` int32 ``[batch]``,
``topk_logprobs`` float32 and ``topk_ids`` int32 ``[batch, top_k]``, ``argmax`` int32 ``[batch]``,
``entropy`` float32 ``[batch]``.
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
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
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


class LogprobRankEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``entropy=True``, no top-k and no argmax (a pytree):
    ``logprobs, ranks, entropy`` (``entropy``: float32 ``[batch]``, each row's entropy)."""

    logprobs: jax.Array
    ranks: jax.Array
    entropy: jax.Array


class LogprobRankTopKEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0`` and ``entropy=True`` (a pytree):
    ``logprobs, ranks, topk_logprobs, topk_ids, entropy``."""

    logprobs: jax.Array
    ranks: jax.Array
    topk_logprobs: jax.Array
    topk_ids: jax.Array
    entropy: jax.Array


class LogprobRankArgmaxEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``argmax=True`` and ``entropy=True``, no top-k (a
    pytree): ``logprobs, ranks, argmax, entropy``."""

    logprobs: jax.Array
    ranks: jax.Array
    argmax: jax.Array
    entropy: jax.Array


class LogprobRankTopKArgmaxEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0``, ``argmax=True`` and ``entropy=True``
    (a pytree): ``logprobs, ranks, topk_logprobs, topk_ids, argmax, entropy``."""

    logprobs: jax.Array
    ranks: jax.Array
    topk_logprobs: jax.Array
    topk_ids: jax.Array
    argmax: jax.Array
    entropy: jax.Array


LogprobResult = (
    LogprobRank
    | LogprobRankTopK
    | LogprobRankArgmax
    | LogprobRankTopKArgmax
    | LogprobRankEntropy
    | LogprobRankTopKEntropy
    | LogprobRankArgmaxEntropy
    | LogprobRankTopKArgmaxEntropy
)
_RESULTS: dict[tuple[bool, bool, bool], type] = {
    (False, False, False): LogprobRank,
    (True, False, False): LogprobRankTopK,
    (False, True, False): LogprobRankArgmax,
    (True, True, False): LogprobRankTopKArgmax,
    (False, False, True): LogprobRankEntropy,
    (True, False, True): LogprobRankTopKEntropy,
    (False, True, True): LogprobRankArgmaxEntropy,
    (True, True, True): LogprobRankTopKArgmaxEntropy,
}


def named_result(fields: Sequence[jax.Array], top_k: int, argmax: bool, entropy: bool = False) -> LogprobResult:
    """The named result for ``(logprobs, ranks[, topk_logprobs, topk_ids][, argmax][, entropy])``."""
    return _RESULTS[(bool(top_k), bool(argmax), bool(entropy))](*fields)
