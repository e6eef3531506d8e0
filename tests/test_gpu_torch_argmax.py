"""GPU tier (marked ``gpu``, skipped without CUDA): ``trace_replay_torch.token_logprob_rank(...,
argmax=True)`` on the Triton kernels at vocab 151,936.

Greedy rows (id -1) mixed with explicit ones in bfloat16, float16 and float32 at batches 1, 7, 256
and 257: the argmax against ``greedy_argmax_reference`` and ``torch.argmax``; every row against the
float64 reference for its token; a greedy row's bits against a call that passes its argmax; the
same row's bits (logprob, rank, argmax) alone and at other positions of larger batches; rows with
thousands of ties at the maximum (the packed-compare tie count), all ``-inf``, all NaN, one NaN;
the adapter's bound-call cache with and without argmax on the same buffers; a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.logprob_cases import POISON_LOGPROB, POISON_RANK, TORCH_DTYPES, assert_matches_reference, round_to  # noqa: E402

from trace_replay_core import greedy_argmax_reference  # noqa: E402

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

VOCAB = 151_936
BATCHES = (1, 7, 256, 257)
POISON_ARGMAX = -777
# Rows that are special in gpu_case (each greedy): name -> row.
SPECIAL = {
    "all-inf": 4,
    "all-nan": 5,
    "one-nan": 6,
    "nan-first-then-inf": 8,
    "plus-inf": 9,
    "max-last-column": 10,
    "max-first-and-last": 11,
    "clipped-ties": 12,
    "clipped-ties-late": 13,
}


def gpu_case(rng: np.random.Generator, batch: int, vocab: int, dtype: str):
    """``[batch, vocab]`` logits exact in ``dtype`` (float32) and ids (-1 = greedy).

    Row ``r`` by ``r % 4``: 0 a unique maximum; 1 the maximum repeated 2-5 times in different
    chunks, the first copy past the middle; 2 values on a grid of 0.5 clipped at 3.0 (about a
    sixth of the row ties at the maximum); 3 values on a grid of 0.5 (a few ties). Then the rows
    of :data:`SPECIAL`. Odd rows and the special rows are greedy; the others carry an explicit id
    (some of them at the maximum, some anywhere).
    """
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * 3.0
    x[x == 0] = 0.25
    for r in range(batch):
        kind = r % 4
        if kind == 0:
            x[r, rng.integers(vocab)] = x[r].max() + 1.0
        elif kind == 1:
            at = rng.choice(np.arange(vocab // 2, vocab), size=int(rng.integers(2, 6)), replace=False)
            x[r, at] = x[r].max() + 0.5
        elif kind == 2:
            x[r] = np.minimum(np.round(x[r] * 2.0) / 2.0, 3.0)
        else:
            x[r] = np.round(x[r] * 2.0) / 2.0
    rows = {name: r for name, r in SPECIAL.items() if r < batch}
    for name, r in rows.items():
        if name == "all-inf":
            x[r] = -np.inf
        elif name == "all-nan":
            x[r] = np.nan
        elif name == "one-nan":
            x[r, vocab // 5] = np.nan
        elif name == "nan-first-then-inf":
            x[r] = -np.inf
            x[r, 0] = np.nan
        elif name == "plus-inf":
            x[r, vocab // 2] = np.inf
        elif name == "max-last-column":
            x[r, -1] = np.nanmax(x[r]) + 0.5
        elif name == "max-first-and-last":
            x[r, [0, vocab - 1]] = np.nanmax(x[r]) + 0.5
        elif name == "clipped-ties":
            x[r] = np.minimum(np.round(x[r] * 2.0) / 2.0, 2.0)
        elif name == "clipped-ties-late":  # the maximum only in the last chunks, many times
            x[r] = np.minimum(np.round(x[r] * 2.0) / 2.0, 1.0)
            x[r, vocab - 20_000 :] = np.where(x[r, vocab - 20_000 :] >= 1.0, 1.5, x[r, vocab - 20_000 :])
    x = round_to(x, dtype)
    ids = rng.integers(0, vocab, size=batch).astype(np.int64)
    ids[::8] = greedy_reference(x[::8])  # some explicit rows name their own argmax
    ids[1::2] = -1
    ids[list(rows.values())] = -1
    return x, ids


def greedy_reference(x: np.ndarray) -> np.ndarray:
    """``greedy_argmax_reference`` by chunks of rows (bounded host memory)."""
    return np.concatenate([greedy_argmax_reference(x[r : r + 32]) for r in range(0, x.shape[0], 32)])


def _cuda(x: np.ndarray, dtype: str):
    return torch.from_numpy(x).to("cuda").to(TORCH_DTYPES[dtype])


def _call(logits, ids, **kw):
    """``token_logprob_rank(..., argmax=True)`` into poisoned caller buffers; host copies."""
    from trace_replay_torch import token_logprob_rank

    b = logits.shape[0]
    out = (
        torch.full((b,), POISON_LOGPROB, device="cuda"),
        torch.full((b,), POISON_RANK, device="cuda"),
        torch.full((b,), POISON_ARGMAX, device="cuda"),
    )
    got = token_logprob_rank(logits, ids, argmax=True, out=out, **kw)
    assert all(g is o for g, o in zip(got, out))
    return tuple(t.cpu().numpy() for t in got)


def _bits(lp: np.ndarray) -> np.ndarray:
    return np.asarray(lp, np.float32).view(np.uint32)


def _check_planted(x: np.ndarray) -> None:
    """The case has what it claims: thousands of ties at the maximum in a clipped row."""
    if x.shape[0] > SPECIAL["clipped-ties"]:
        row = x[SPECIAL["clipped-ties"]]
        assert (row == row.max()).sum() > 1000


@needs_gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_gpu_argmax_greedy_rows_and_batch_invariance(dtype):
    rng = np.random.default_rng({"bfloat16": 1, "float16": 2, "float32": 3}[dtype])
    x_all, ids_all = gpu_case(rng, max(BATCHES), VOCAB, dtype)
    _check_planted(x_all)
    want_all = greedy_reference(x_all)
    logits_all, ids_t_all = _cuda(x_all, dtype), torch.from_numpy(ids_all).cuda()
    # batch 256 takes rows 1..256 (every row at another position); the others start at row 0.
    starts = {1: 0, 7: 0, 256: 1, 257: 0}
    results = {}
    for batch in BATCHES:
        s = slice(starts[batch], starts[batch] + batch)
        x, ids, want = x_all[s], ids_all[s], want_all[s]
        logits, ids_t = logits_all[s], ids_t_all[s]
        lp, rk, am = _call(logits, ids_t)
        what = f"{dtype} batch {batch}"
        bad = np.flatnonzero(am != want)
        assert bad.size == 0, (
            f"{what}: argmax differs at rows {bad[:10].tolist()}: got {am[bad[:10]].tolist()}, "
            f"want {want[bad[:10]].tolist()}"
        )
        no_nan = ~np.isnan(x).any(axis=1)
        torch_am = logits.argmax(dim=-1).cpu().numpy()
        bad = np.flatnonzero(no_nan & (am != torch_am))
        assert bad.size == 0, f"{what}: argmax differs from torch.argmax at rows {bad[:10].tolist()}"
        assert_matches_reference(x, np.where(ids < 0, want, ids), lp, rk, what)
        assert (ids_t.cpu().numpy() == ids).all(), f"{what}: token_ids was written"
        # Greedy rows: the bits of an explicit call with the argmax ids (with and without argmax).
        explicit = torch.from_numpy(np.where(ids < 0, am, ids)).cuda()
        from trace_replay_torch import token_logprob_rank

        plain_lp, plain_rk = (t.cpu().numpy() for t in token_logprob_rank(logits, explicit))
        lp2, rk2, am2 = _call(logits, explicit)
        for name, (lp_x, rk_x) in {"without argmax": (plain_lp, plain_rk), "with argmax": (lp2, rk2)}.items():
            bad = np.flatnonzero((_bits(lp_x) != _bits(lp)) | (rk_x != rk))
            assert bad.size == 0, f"{what}: explicit ids {name} differ at rows {bad[:10].tolist()}"
        assert (am2 == am).all()
        results[batch] = (s, lp, rk, am)
    # Batch invariance: every row has the bits it has in the full batch, whatever the batch and position.
    _, lp_full, rk_full, am_full = results[max(BATCHES)]
    for batch, (s, lp, rk, am) in results.items():
        rows = np.arange(s.start, s.stop)
        bad = np.flatnonzero((_bits(lp) != _bits(lp_full[rows])) | (rk != rk_full[rows]) | (am != am_full[rows]))
        assert bad.size == 0, f"{dtype}: batch {batch} differs from batch 257 at rows {(rows[bad][:10]).tolist()}"
    for r in sorted(set(SPECIAL.values()) | {0, 1, 2, 3, 100, 255, 256}):
        lp, rk, am = _call(logits_all[r : r + 1], ids_t_all[r : r + 1])
        assert (_bits(lp)[0], rk[0], am[0]) == (_bits(lp_full)[r], rk_full[r], am_full[r]), (
            f"{dtype}: row {r} alone differs from row {r} of batch 257"
        )


@needs_gpu
def test_gpu_special_rows_say_what_the_contract_says():
    x, ids = gpu_case(np.random.default_rng(7), 16, VOCAB, "bfloat16")
    lp, rk, am = _call(_cuda(x, "bfloat16"), torch.from_numpy(ids).cuda())
    s = SPECIAL
    assert (am[s["all-inf"]], rk[s["all-inf"]]) == (0, VOCAB) and np.isnan(lp[s["all-inf"]])
    assert (am[s["all-nan"]], rk[s["all-nan"]]) == (0, 0) and np.isnan(lp[s["all-nan"]])
    assert am[s["nan-first-then-inf"]] == 1 and np.isnan(lp[s["nan-first-then-inf"]])  # never the NaN
    one_nan = x[s["one-nan"]]  # a clipped row: its maximum ties many times
    assert am[s["one-nan"]] == np.nanargmax(one_nan) and np.isnan(lp[s["one-nan"]])
    assert rk[s["one-nan"]] == (one_nan == np.nanmax(one_nan)).sum() > 100
    assert am[s["plus-inf"]] == VOCAB // 2 and np.isnan(lp[s["plus-inf"]]) and rk[s["plus-inf"]] == 1
    assert am[s["max-last-column"]] == VOCAB - 1 and rk[s["max-last-column"]] == 1
    assert am[s["max-first-and-last"]] == 0 and rk[s["max-first-and-last"]] == 2
    for name in ("clipped-ties", "clipped-ties-late"):
        row = x[s[name]]
        ties = np.flatnonzero(row == row.max())
        assert ties.size > 100 and am[s[name]] == ties[0] and rk[s[name]] == ties.size, name


@needs_gpu
def test_gpu_cache_with_and_without_argmax_on_the_same_buffers():
    """The adapter binds per layout, argmax included: the same logits, ids and outputs with and
    without argmax must be two launches (a greedy row is invalid without argmax, scored with it),
    and a hit must read the buffers' current contents. The registered op gives the same bits."""
    from trace_replay_torch import token_logprob_rank, token_logprob_rank_op

    rng = np.random.default_rng(11)
    logits = torch.empty(7, VOCAB, dtype=torch.bfloat16, device="cuda")
    ids_t = torch.empty(7, dtype=torch.int64, device="cuda")
    lp, rk = torch.empty(7, device="cuda"), torch.empty(7, dtype=torch.int32, device="cuda")
    am = torch.empty(7, dtype=torch.int32, device="cuda")
    for k in range(3):
        x, ids = gpu_case(rng, 7, VOCAB, "bfloat16")
        logits.copy_(torch.from_numpy(x).to(torch.bfloat16))
        ids_t.copy_(torch.from_numpy(ids))
        for with_argmax in (False, True, False, True):
            lp.fill_(POISON_LOGPROB), rk.fill_(POISON_RANK), am.fill_(POISON_ARGMAX)
            if with_argmax:
                token_logprob_rank(logits, ids_t, argmax=True, out=(lp, rk, am))
                want = greedy_reference(x)
                assert am.cpu().numpy().tolist() == want.tolist(), f"step {k}"
                assert_matches_reference(
                    x, np.where(ids < 0, want, ids), lp.cpu().numpy(), rk.cpu().numpy(), f"with argmax, step {k}"
                )
            else:
                token_logprob_rank(logits, ids_t, out=(lp, rk))
                assert (am == POISON_ARGMAX).all() and (rk.cpu().numpy()[ids < 0] == -1).all(), f"step {k}"
        op = token_logprob_rank_op(logits, ids_t, argmax=True)
        assert np.array_equal(_bits(op.logprobs.cpu().numpy()), _bits(lp.cpu().numpy()))
        assert torch.equal(op.ranks, rk.long()) and torch.equal(op.argmax, am.long())


@needs_gpu
def test_gpu_cuda_graph_of_the_greedy_step():
    """``fill(-1)``, explicit ids on even rows, the call with argmax, and the greedy rows taking
    their argmax, captured once (after an eager warm-up) and replayed on new logits and ids."""
    from trace_replay_torch import token_logprob_rank

    batch = 7
    logits = torch.empty(batch, VOCAB, dtype=torch.bfloat16, device="cuda")
    ids_static = torch.empty(batch, dtype=torch.int64, device="cuda")
    sampled = torch.empty(batch, dtype=torch.int64, device="cuda")
    lp, rk = torch.empty(batch, device="cuda"), torch.empty(batch, dtype=torch.int64, device="cuda")
    am = torch.empty(batch, dtype=torch.int64, device="cuda")
    greedy = torch.empty(batch, dtype=torch.bool, device="cuda")

    def step():
        sampled.fill_(-1)
        sampled[::2].copy_(ids_static[::2])  # the explicit rows ("replayed")
        token_logprob_rank(logits, sampled, argmax=True, out=(lp, rk, am))
        torch.lt(sampled, 0, out=greedy)
        torch.where(greedy, am, sampled, out=sampled)

    def load(seed):
        x, ids = gpu_case(np.random.default_rng(seed), batch, VOCAB, "bfloat16")
        logits.copy_(torch.from_numpy(x).to(torch.bfloat16))
        ids_static.copy_(torch.from_numpy(ids))
        scored = ids.copy()
        scored[1::2] = -1
        return x, scored

    load(20)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels, binds the launch
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (21, 22):
        x, scored = load(seed)
        lp.fill_(POISON_LOGPROB), rk.fill_(POISON_RANK), am.fill_(POISON_ARGMAX)
        graph.replay()
        torch.cuda.synchronize()
        want = greedy_reference(x)
        assert am.cpu().numpy().tolist() == want.tolist(), f"graph, seed {seed}"
        assert sampled.cpu().numpy().tolist() == np.where(scored < 0, want, scored).tolist(), f"graph, seed {seed}"
        assert_matches_reference(
            x, np.where(scored < 0, want, scored), lp.cpu().numpy(), rk.cpu().numpy(), f"graph, seed {seed}"
        )
        eager_lp, eager_rk, eager_am = _call(logits, torch.from_numpy(scored).cuda())
        assert np.array_equal(_bits(eager_lp), _bits(lp.cpu().numpy()))
        assert (eager_rk == rk.cpu().numpy()).all() and (eager_am == am.cpu().numpy()).all()
