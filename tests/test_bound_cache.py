"""BoundCache: one bind per key, entries hold no arrays, oldest entry dropped first."""

import re

import numpy as np
import pytest

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
    assert first.views == ()  # no capsule keeps the arrays alive
    first(stream=0)  # still launches what it was bound to
    assert np.all(rk >= 1) and np.all(np.isfinite(lp))
    cache.bind("b", bind)
    cache.bind("c", bind)  # size 2: "a", the oldest, goes
    assert list(cache) == ["b", "c"] and len(calls) == 3
    assert cache.get("a") is None


def test_entries_go_in_only_through_bind():
    """Item assignment and update would bypass the size limit and the lock: BoundCache is no
    dict and has neither; what it reads like a mapping (get, in, len, iteration, clear) stays."""
    cache = BoundCache(2)
    with pytest.raises(TypeError, match=r"^'BoundCache' object does not support item assignment$"):
        cache["a"] = object()
    assert not any(hasattr(cache, name) for name in ("update", "setdefault", "pop", "__setitem__"))
    kept = {k: cache.bind(k, object) for k in "abcd"}
    assert list(cache) == ["c", "d"] and len(cache) == 2 and "c" in cache and "a" not in cache
    assert cache.get("d") is kept["d"] and cache.get("a") is None and cache.get("a", 5) == 5
    cache.clear()
    assert len(cache) == 0 and cache.get("d") is None


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


def test_concurrent_misses_bind_each_key_once_and_keep_the_bound():
    """BoundCache is thread-safe: 8 threads asking for the same 16 keys bind each exactly once,
    every thread gets the one cached launch, and eviction keeps the size bound."""
    import threading

    from helpers import run_threads

    cache = BoundCache(16)
    counts, lock, got = {}, threading.Lock(), {}

    def bind_for(key):
        def bind():
            with lock:
                counts[key] = counts.get(key, 0) + 1
            return object()

        return bind

    def worker(i):
        got[i] = [cache.bind(k, bind_for(k)) for k in range(16) for _ in range(20)]

    run_threads(worker, 8)
    assert counts == {k: 1 for k in range(16)}
    assert all(got[i] == got[0] for i in got) and len(cache) == 16
    cache.bind("extra", bind_for("extra"))
    assert len(cache) == 16 and 0 not in cache  # the oldest key went


def test_replay_cached_from_many_threads(rng):
    """TraceTable.replay_cached is thread-safe: 8 threads replaying their own buffers under their
    own keys (binding concurrently, then hitting the cache) all get the reference's tokens."""
    from helpers import run_threads

    from trace_replay_core import replay_reference

    max_slots, length = 16, 32
    with TraceTable(max_slots, length, device="cpu") as table:
        traces = {s: rng.integers(0, 1000, length) for s in range(max_slots)}
        table.stage_many(list(traces), np.stack(list(traces.values())))
        table.commit(stream=0)
        total = rng.integers(0, length, max_slots).astype(np.int32)
        prompt = np.zeros(max_slots, np.int32)
        table.bind_lengths(total, prompt, stream=0)
        snapshot = table.snapshot()
        failures = []

        def worker(i):
            idx = np.random.default_rng(i).integers(-1, max_slots, 8).astype(np.int32)
            sampled = np.full(8, -5, np.int64)
            want = replay_reference(sampled, idx, *snapshot, total, prompt)
            for _ in range(200):
                sampled[:] = -5
                table.replay_cached(("thread", i, sampled.ctypes.data), sampled, idx, stream=0)
                if not np.array_equal(sampled, want):
                    failures.append(i)
                    return

        run_threads(worker, 8)
        assert failures == []


def _bound_pair(rng, wrap):
    """A bound logprob call and a bound replay over fresh arrays, each passed through ``wrap``."""
    table = TraceTable(4, 8, device="cpu")
    table.stage(1, [5, 6, 7])
    table.commit(stream=0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    arrays = dict(
        logits=logits, ids=np.array([4, 9, 17]), lp=np.zeros(3, np.float32), rk=np.zeros(3, np.int64),
        sampled=np.array([9, 9], np.int64), idx=np.array([1, 0], np.int32),
        total=np.array([0, 3, 0, 0], np.int32), prompt=np.array([0, 2, 0, 0], np.int32),
    )  # fmt: skip
    a = {k: wrap(k, v) for k, v in arrays.items()}
    logprob = bind_logprob_rank(a["logits"], a["ids"], out_logprobs=a["lp"], out_ranks=a["rk"], stream=0)
    replay = table.bind_replay(a["sampled"], a["idx"], a["total"], a["prompt"], stream=0)
    return table, logprob, replay, arrays, a


def test_release_leaves_the_callers_views_alone(rng):
    """An ArrayView the caller passes is used as it is (as_view returns it): release() drops the
    bound object's references and leaves the caller's views, capsules included, untouched."""
    from trace_replay_core import as_view

    table, logprob, replay, arrays, views = _bound_pair(rng, lambda name, a: as_view(a, name=name))
    capsules = {k: v.keepalive for k, v in views.items()}
    logprob.release()
    replay.release()
    assert logprob.views == () and replay.views == ()
    assert {k: v.keepalive for k, v in views.items()} == capsules and all(capsules.values())
    logprob(stream=0)
    replay(stream=0)
    assert arrays["sampled"].tolist() == [6, 9] and np.all(arrays["rk"] >= 1)
    table.close()


def test_released_bound_calls_keep_no_array_alive(rng):
    """After release() nothing of a bound call (not even the numpy backend's launch) holds the
    arrays: dropped by the caller, they are freed."""
    import gc
    import weakref

    table, logprob, replay, arrays = _bound_pair(rng, lambda name, a: a)[:4]
    refs = {k: weakref.ref(a) for k, a in arrays.items()}
    logprob.release()
    replay.release()
    del arrays
    gc.collect()
    assert [k for k, r in refs.items() if r() is not None] == []
    table.close()


@pytest.mark.parametrize("size", [0, -3, 2.0, True, None])
def test_size_must_be_a_positive_int(size):
    with pytest.raises(ValueError, match=rf"^size must be a positive int \(got \w+ {re.escape(repr(size))}\)$"):
        BoundCache(size)
