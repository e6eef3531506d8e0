"""The named results of the torch adapter's ``token_logprob_rank``: one ``NamedTuple`` per
combination of options (top-k, greedy token, entropy), and how a call's output slots become one."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

__all__ = [
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
    "LogprobRankResult",
    "result_type",
    "named_result",
]


class LogprobRank(NamedTuple):
    """``token_logprob_rank``'s result without top-k: unpacks as ``logprobs, ranks``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor


class LogprobRankTopK(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0``:
    ``logprobs, ranks, topk_logprobs, topk_ids``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor


class LogprobRankArgmax(NamedTuple):
    """``token_logprob_rank``'s result with ``argmax=True`` and no top-k:
    ``logprobs, ranks, argmax``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    argmax: torch.Tensor


class LogprobRankTopKArgmax(NamedTuple):
    """``token_logprob_rank``'s result with ``argmax=True`` and ``top_k > 0``:
    ``logprobs, ranks, topk_logprobs, topk_ids, argmax``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    argmax: torch.Tensor


class LogprobRankEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``entropy=True``, no top-k and no argmax:
    ``logprobs, ranks, entropy``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    entropy: torch.Tensor


class LogprobRankTopKEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``entropy=True`` and ``top_k > 0``:
    ``logprobs, ranks, topk_logprobs, topk_ids, entropy``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    entropy: torch.Tensor


class LogprobRankArgmaxEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``argmax=True``, ``entropy=True`` and no top-k:
    ``logprobs, ranks, argmax, entropy``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor


class LogprobRankTopKArgmaxEntropy(NamedTuple):
    """``token_logprob_rank``'s result with ``top_k > 0``, ``argmax=True`` and ``entropy=True``:
    ``logprobs, ranks, topk_logprobs, topk_ids, argmax, entropy``."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor


LogprobRankResult = (
    LogprobRank
    | LogprobRankTopK
    | LogprobRankArgmax
    | LogprobRankTopKArgmax
    | LogprobRankEntropy
    | LogprobRankTopKEntropy
    | LogprobRankArgmaxEntropy
    | LogprobRankTopKArgmaxEntropy
)
# (top_k > 0, argmax, entropy) -> the result's type
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


def result_type(top_k: int, argmax: bool, entropy: bool) -> type:
    """The named tuple of a call's result (fields: logprobs, ranks[, topk_logprobs,
    topk_ids][, argmax][, entropy])."""
    return _RESULTS[(top_k > 0, argmax, entropy)]


# (top_k > 0, argmax, entropy) -> the six output slots' indices the result holds, as a getter
_SLOTS = {
    key: operator.itemgetter(*(i for i, has in enumerate((True, True, key[0], key[0], key[1], key[2])) if has))
    for key in _RESULTS
}


def named_result(outs, top_k: int, argmax: bool, entropy: bool) -> LogprobRankResult:
    """The named result of the six output slots (logprobs, ranks, topk logprobs, topk ids,
    argmax, entropy): the slots the call has, in that order. (On the eager hot path: one
    lookup and one getter, no generator.)"""
    key = (top_k > 0, argmax, entropy)
    return _RESULTS[key](*_SLOTS[key](outs))
