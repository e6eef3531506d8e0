"""The near-tie rank check of ``llama_cases`` (used wherever two arithmetics are compared):
exact where a gap decides the rank, open only inside a near-tie, and never for an off-by-one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.llama_cases import RANK_EPS, check_against_hf, check_ranks, check_same, rank_bounds  # noqa: E402

from trace_replay_app.records import RequestResult, TraceRequest  # noqa: E402


def _spaced(rng, rows, vocab):
    """Random logits whose entries of a row lie at least 0.009 apart (a grid of 0.01 in a random
    order, jittered by under 0.001): no near-tie within ``RANK_EPS`` unless a test plants one."""
    grid = np.stack([rng.permutation(vocab) for _ in range(rows)]) * 0.01 - vocab * 0.005
    return grid + rng.uniform(0.0, 1e-3, size=(rows, vocab))


def _result(ranks, argmax, tokens):
    return SimpleNamespace(ranks=np.asarray(ranks), argmax=np.asarray(argmax), tokens=np.asarray(tokens))


def test_bounds_are_exact_without_a_near_tie_and_open_inside_one(rng):
    logits = _spaced(rng, 3, 257)
    tokens = np.array([5, 17, 200])
    own = logits[np.arange(3), tokens]
    logits[1, 99] = own[1] + RANK_EPS / 3  # a near-tie just above token 17
    logits[2, 98] = own[2] - RANK_EPS / 3  # and one just below token 200
    exact = (logits >= own[:, None]).sum(axis=1)
    lo, hi = rank_bounds(logits, tokens)
    assert lo[0] == hi[0] == exact[0]
    assert (lo[1], hi[1]) == (exact[1] - 1, exact[1])
    assert (lo[2], hi[2]) == (exact[2], exact[2] + 1)


def test_check_ranks_refuses_an_off_by_one_and_a_wrong_argmax(rng):
    logits = _spaced(rng, 2, 101)
    tokens = np.argsort(logits, axis=1)[:, 50]  # mid-vocabulary: neither the top nor the runner-up
    ranks = (logits >= logits[np.arange(2), tokens][:, None]).sum(axis=1)
    top = logits.argmax(axis=1)
    check_ranks(_result(ranks, top, tokens), logits, "exact")
    with pytest.raises(AssertionError, match=r"ranks \[.*\] at positions \[0\]"):
        check_ranks(_result(ranks + [1, 0], top, tokens), logits, "off by one")
    second = np.argsort(logits, axis=1)[:, -2]
    with pytest.raises(AssertionError, match="argmax"):
        check_ranks(_result(ranks, second, tokens), logits, "runner-up")
    logits[0, second[0]] = logits[0, top[0]] - RANK_EPS / 2  # a near-tie at the top: either argmax passes
    check_ranks(_result(ranks, [second[0], top[1]], tokens), logits, "tied top")


class _TableModel:
    """A stand-in for a transformers model whose logits at position ``p`` are ``table[p]``."""

    device = "cpu"

    def __init__(self, table):
        self.table = torch.tensor(table, dtype=torch.float32)

    def __call__(self, ids):
        return SimpleNamespace(logits=self.table[None, : ids.shape[1]])

    def generate(self, ids, *, max_new_tokens, **_):
        """Greedy: at position p the argmax of ``table[p]`` (ties: the lowest id)."""
        start = ids.shape[1]
        new = self.table[start - 1 : start - 1 + max_new_tokens].argmax(dim=1)
        return torch.cat([ids[0], new])[None]


def _run(tokens, logits, prompt_len, traced):
    tokens = np.asarray(tokens)
    at = logits[prompt_len - 1 : prompt_len - 1 + tokens.size]
    own = at[np.arange(tokens.size), tokens]
    lp = (own - np.log(np.exp(at).sum(axis=1))).astype(np.float32)
    return RequestResult(
        "r", tokens, np.full(tokens.size, traced), lp, (at >= own[:, None]).sum(axis=1), at.argmax(axis=1)
    )


def test_check_same_lets_free_runs_part_only_at_a_near_tie_at_the_top(rng):
    table = _spaced(rng, 8, 40)
    prompt = (1, 2)
    table[2, 7] = table[2].max() + 1.0
    table[2, 9] = table[2, 7] - RANK_EPS / 4  # position 1 of the decode: 7 and 9 nearly tie at the top
    model = _TableModel(table)
    free = TraceRequest("r", prompt=prompt, max_new_tokens=4)
    a = _run([3, 7, 5, 6], table.astype(np.float64), len(prompt), False)
    b = _run([3, 9, 1, 1], table.astype(np.float64), len(prompt), False)
    check_same([a], [b], "parted at a tie", reference=model, requests=[free])
    c = _run([3, 11, 1, 1], table.astype(np.float64), len(prompt), False)
    with pytest.raises(AssertionError, match="without a near-tie"):
        check_same([a], [c], "parted without a tie", reference=model, requests=[free])
    traced = TraceRequest("r", prompt=prompt, trace=(3, 7, 5, 6))
    with pytest.raises(AssertionError, match="tokens differ"):
        check_same([a], [b], "traced", reference=model, requests=[traced])
    with pytest.raises(TypeError, match="reference="):
        check_same([a], [a], "no reference", atol=1e-5)
    worse = _run([3, 7, 5, 6], table.astype(np.float64), len(prompt), False)
    worse.ranks[2] += 1
    with pytest.raises(AssertionError, match="ranks"):
        check_same([a], [worse], "rank off by one", reference=model, requests=[free])


def test_check_against_hf_lets_greedy_part_from_generate_only_at_a_near_tie(rng):
    table = _spaced(rng, 8, 40)
    prompt = (1, 2)
    table[3, 9] = table[3].max() + 1.0
    table[3, 7] = table[3, 9] - RANK_EPS / 4  # decode position 2: 9 (generate's) and 7 nearly tie
    model = _TableModel(table)
    free = TraceRequest("r", prompt=prompt, max_new_tokens=4)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=4)[0, 2:].tolist()
    exact = _run(want, table.astype(np.float64), len(prompt), False)
    check_against_hf(model, [free], [exact], "equal to generate")
    parted = _run(want[:2] + [7, 0], table.astype(np.float64), len(prompt), False)
    check_against_hf(model, [free], [parted], "parted at the tie")
    other = int(np.argsort(table[3])[0])  # the lowest logit: no tie with generate's token
    with pytest.raises(AssertionError, match="without a near-tie"):
        check_against_hf(
            model,
            [free],
            [_run(want[:2] + [other, 0], table.astype(np.float64), len(prompt), False)],
            "parted without a tie",
        )
