"""trace_replay_torch: trace replay for PyTorch decode loops.

Example (runs on the CPU; use ``device="cuda"`` on a GPU)::

    import torch
    from trace_replay_torch import TraceReplayState

    total_len = torch.tensor([4, 0, 11, 0], dtype=torch.int32)   # per slot: prompt + outputs
    prompt_len = torch.tensor([4, 0, 10, 0], dtype=torch.int32)
    with TraceReplayState(4, 8, device="cpu", total_len=total_len, prompt_len=prompt_len) as state:
        state.add_request(2, [5, 6, 7])        # slot 2 replays this trace
        state.apply_staged_writes()
        sampled = torch.tensor([9, 9])         # what the sampler drew, rows -> slots [2, 0]
        state.replay(sampled, torch.tensor([2, 0], dtype=torch.int32))
        assert sampled.tolist() == [6, 9]      # slot 2 is at step 1 of its trace

The methods above and :func:`token_logprob_rank` compile as they are: inside ``torch.compile``
(``fullgraph=True`` too) they become registered ops, and a CUDA graph captures them once warmed
up. The ``_op`` forms, ``replay_op(state, sampled, idx_mapping)``, ``replay_at_step_op`` and
``token_logprob_rank_op``, call the same ops directly (see :mod:`trace_replay_torch.ops`):
optional, for code that wants the op in every mode.

A greedy step reads the logits once: fill ``sampled`` with -1, replay, then
``token_logprob_rank(logits, sampled, argmax=True)`` returns each row's greedy token and scores
the rows still at -1 as it (see :func:`token_logprob_rank`); ``entropy=True`` adds each row's
entropy from the same read.
"""

from trace_replay_core import StagedWritesWarning

from .logprob import (
    LogprobRank,
    LogprobRankArgmax,
    LogprobRankArgmaxEntropy,
    LogprobRankEntropy,
    LogprobRankTopK,
    LogprobRankTopKArgmax,
    LogprobRankTopKArgmaxEntropy,
    LogprobRankTopKEntropy,
    token_logprob_rank,
)
from .ops import replay_at_step_op, replay_op, token_logprob_rank_op
from .state import TraceReplayState

__all__ = [
    "TraceReplayState",
    "StagedWritesWarning",
    "token_logprob_rank",
    "LogprobRank",
    "LogprobRankTopK",
    "LogprobRankArgmax",
    "LogprobRankTopKArgmax",
    "LogprobRankEntropy",
    "LogprobRankTopKEntropy",
    "LogprobRankArgmaxEntropy",
    "LogprobRankTopKArgmaxEntropy",
    "replay_op",
    "replay_at_step_op",
    "token_logprob_rank_op",
]
