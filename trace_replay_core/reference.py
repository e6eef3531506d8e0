"""The numpy reference of the replay semantics: plain, row by row, obviously right.

Tests, the CPU backend's checks and ``bench/`` compare against these functions; nothing here
is meant to be fast. All inputs are numpy arrays; nothing is modified; results are new arrays.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["replay_reference", "token_logprob_rank_reference"]


def replay_reference(sampled: np.ndarray, idx_mapping: np.ndarray, table: np.ndarray,
                     trace_len: np.ndarray, total_len: Optional[np.ndarray] = None,
                     prompt_len: Optional[np.ndarray] = None,
                     step: Optional[np.ndarray] = None) -> np.ndarray:
    """Return a copy of ``sampled`` with traced rows replaced by their trace token.

    ``table`` is ``[max_slots, max_trace_len]``, ``trace_len`` ``[max_slots]``. Give either
    ``total_len`` and ``prompt_len`` (per slot) or ``step`` (per row).
    """
    if (step is None) == (total_len is None or prompt_len is None):
        raise ValueError("give either step, or both total_len and prompt_len")
    out = np.array(sampled, copy=True)
    flat = out.reshape(-1)
    max_slots = table.shape[0]
    for b in range(flat.shape[0]):
        slot = int(idx_mapping[b])
        if slot < 0 or slot >= max_slots:
            continue
        n = int(trace_len[slot])
        if n <= 0:
            continue
        s = int(step[b]) if step is not None else int(total_len[slot]) - int(prompt_len[slot])
        if s < 0 or s >= n:
            continue
        flat[b] = table[slot, s]
    return out


def token_logprob_rank_reference(logits: np.ndarray, token_ids: np.ndarray):
    """float64 log-softmax value and rank of ``token_ids[b]`` in row ``b`` of ``logits``.

    The rank counts the vocabulary entries whose logit is greater than or equal to the token's
    own (so a unique argmax has rank 1 and ties count against the token).
    """
    x = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(token_ids).astype(np.int64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    chosen = x[np.arange(x.shape[0]), ids]
    ranks = (x >= chosen[:, None]).sum(axis=1)
    return chosen - lse, ranks.astype(np.int64)
