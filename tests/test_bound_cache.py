"""BoundCache: one bind per key, entries hold no arrays, oldest entry dropped first."""

import numpy as np

from trace_replay_core import TraceTable, bind_logprob_rank
from trace_replay_core._bound_cache import BoundCache


def test_binds_once_per_key_drops_views_and_evicts_oldest(rng):
    calls = []
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    ids = rng.integers(0, 50, 3)
    lp, rk = np.full(3, 777.0, np.float32), np.full(3, -999, np.int64)

    def bind():
        calls.append(1)
        return bind_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, stream=0)

    cache = BoundCache(2)
    first = cache.bind("a", bind)
    assert cache.bind("a", bind) is first and len(calls) == 1
    assert first.views == ()                       # no capsule keeps the arrays alive
    first(stream=0)                                # still launches what it was bound to
    assert np.all(rk >= 1) and np.all(np.isfinite(lp))
    cache.bind("b", bind)
    cache.bind("c", bind)                          # size 2: "a", the oldest, goes
    assert list(cache) == ["b", "c"] and len(calls) == 3
    assert cache.get("a") is None


def test_bound_replay_views_lose_their_capsules(rng):
    with TraceTable(4, 8, device="cpu") as table:
        table.stage(1, [5, 6, 7])
        table.commit(stream=0)
        sampled = np.array([9, 9], np.int64)
        idx = np.array([1, 0], np.int32)
        total, prompt = np.array([0, 3, 0, 0], np.int32), np.array([0, 2, 0, 0], np.int32)
        bound = BoundCache(4).bind("k", lambda: table.bind_replay(sampled, idx, total, prompt, stream=0))
        assert bound.views == ()
        bound(stream=0)
        assert sampled.tolist() == [6, 9]
