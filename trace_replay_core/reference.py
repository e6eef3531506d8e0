"""The numpy reference of the replay semantics: plain, row by row, obviously right.

Tests, the CPU backend's checks and ``bench/`` compare against these functions; nothing here
is meant to be fast. All inputs are numpy arrays; nothing is modified; results are new arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["replay_reference", "token_logprob_rank_reference", "greedy_argmax_reference", "softmax_entropy_reference"]


def replay_reference(
    sampled: np.ndarray,
    idx_mapping: np.ndarray,
    table: np.ndarray,
    trace_len: np.ndarray,
    total_len: np.ndarray | None = None,
    prompt_len: np.ndarray | None = None,
    step: np.ndarray | None = None,
) -> np.ndarray:
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
        if step is not None:
            s = int(step[b])
        else:
            assert total_len is not None and prompt_len is not None  # checked above
            s = int(total_len[slot]) - int(prompt_len[slot])
        if s < 0 or s >= n:
            continue
        flat[b] = table[slot, s]
    return out


def token_logprob_rank_reference(logits: np.ndarray, token_ids: np.ndarray):
    """float64 log-softmax value and rank of ``token_ids[b]`` in row ``b`` of ``logits``.

    Returns ``(logprobs, ranks)``: float64 and int64 arrays of ``[batch]``. The rank counts the
    vocabulary entries whose logit is greater than or equal to the token's own (so a unique
    argmax has rank 1 and ties count against the token).

    Special values, as in :func:`trace_replay_core.token_logprob_rank`: a row holding a NaN or
    a ``+inf``, or only ``-inf`` entries, has logprob NaN; ranks are IEEE counts (NaN entries
    never count); a token id outside ``[0, vocab)`` gives logprob NaN and rank -1.
    """
    x = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(token_ids).reshape(-1).astype(np.int64)
    vocab = x.shape[1]
    valid = (ids >= 0) & (ids < vocab)
    chosen = x[np.arange(x.shape[0]), np.where(valid, ids, 0)]
    chosen = np.where(valid, chosen, np.nan)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = x.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
        logprobs = chosen - lse
        ranks = (x >= chosen[:, None]).sum(axis=1)
    return np.where(valid, logprobs, np.nan), np.where(valid, ranks, -1).astype(np.int64)


def greedy_argmax_reference(logits: np.ndarray) -> np.ndarray:
    """The greedy token of each row of ``logits`` (int64 ``[batch]``): the lowest id among the
    row's largest non-NaN entries, 0 when every entry is NaN, as
    :func:`trace_replay_core.token_logprob_rank` writes to ``out_argmax``. A negative token id
    scored with ``out_argmax`` is scored as this token (pass it to
    :func:`token_logprob_rank_reference`)."""
    x = np.asarray(logits, dtype=np.float64)
    top = np.max(x, axis=1, initial=-np.inf, where=~np.isnan(x), keepdims=True)
    return np.argmax(x == top, axis=1).astype(np.int64)  # the first entry equal to it; none: 0


def softmax_entropy_reference(logits: np.ndarray) -> np.ndarray:
    """float64 Shannon entropy (natural log) of ``softmax(logits[b])`` per row (``[batch]``), as
    :func:`trace_replay_core.token_logprob_rank` writes to ``out_entropy`` (pass ``logits / T``
    for a temperature). ``-inf`` entries have probability 0 and add nothing; a row holding a NaN
    or a ``+inf``, or only ``-inf`` entries, has entropy NaN."""
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = x.max(axis=1, keepdims=True)  # NaN, +inf or all -inf: NaN below
        z = x - m
        p = np.exp(z)
        total = p.sum(axis=1)
        plogp = np.where(p > 0, p * z, 0.0).sum(axis=1)
        return np.log(total) - plogp / total
