"""Test helpers: random replay scenarios and mismatch reports."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading
import types

import numpy as np

POISON = -7  # written into outputs beforehand: a row the code forgot stays visibly wrong


def random_scenario(
    rng,
    *,
    max_slots: int,
    max_trace_len: int,
    batch: int,
    sampled_dtype=np.int64,
    index_dtype=np.int32,
    vocab: int = 50_000,
):
    """A committed table state plus one step's inputs covering every row category.

    Rows hit: slot -1, slots with no trace, steps before (< 0), inside and past the trace, and
    out-of-range slots. Returns a dict of numpy arrays.
    """
    table = np.full((max_slots, max_trace_len), -1, dtype=np.int32)
    trace_len = np.zeros(max_slots, dtype=np.int32)
    traces = {}
    for slot in range(max_slots):
        if rng.random() < 0.75:
            n = int(rng.integers(1, max_trace_len + 1))
            tr = rng.integers(0, vocab, n).astype(np.int32)
            table[slot, :n] = tr
            trace_len[slot] = n
            traces[slot] = tr
    prompt_len = rng.integers(0, 100, max_slots)
    step = rng.integers(-3, max_trace_len + 3, max_slots)
    total_len = prompt_len + step
    idx = rng.integers(0, max_slots, batch)
    special = rng.random(batch)
    idx[special < 0.1] = -1
    idx[(special >= 0.1) & (special < 0.13)] = max_slots + 3  # out of range: left alone
    sampled = rng.integers(0, vocab, batch)
    per_row_step = rng.integers(-3, max_trace_len + 3, batch)
    return dict(
        traces=traces,
        table=table,
        trace_len=trace_len,
        prompt_len=prompt_len.astype(index_dtype),
        total_len=total_len.astype(index_dtype),
        idx=idx.astype(index_dtype),
        sampled=sampled.astype(sampled_dtype),
        step=per_row_step.astype(index_dtype),
    )


def assert_tokens_equal(got, expected, what: str = "tokens") -> None:
    got = np.asarray(got)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    bad = np.nonzero(got.reshape(-1) != expected.reshape(-1))[0]
    assert bad.size == 0, (
        f"{what}: {bad.size} mismatching rows, first {bad[:10].tolist()}: got "
        f"{got.reshape(-1)[bad[:10]].tolist()} expected {expected.reshape(-1)[bad[:10]].tolist()}"
    )


def admit_requests(rng, add_request, table, lens, step_of, *, count: int, vocab: int) -> None:
    """Soak helper: ``count`` random slots get a new request (30% untraced), mirrored on the host.

    ``table``/``lens`` mirror what the library will hold after the next commit; ``step_of`` is
    each slot's step, reset to -2 (the new request's prompt is still being read).
    """
    max_slots, max_len = table.shape
    for slot in rng.choice(max_slots, size=count, replace=False):
        slot = int(slot)
        if rng.random() < 0.3:
            add_request(slot, None)
            lens[slot] = 0
        else:
            tr = rng.integers(0, vocab, int(rng.integers(1, max_len + 1)))
            add_request(slot, tr)
            table[slot, : len(tr)] = tr
            lens[slot] = len(tr)
        step_of[slot] = -2


def check_soak(got, base_all, idx_all, total_all, prompt, tables):
    """Compare every soak step with the reference; return (mismatching rows, forced tokens, first).

    ``tables`` lists ``(first step, table, lens)`` whenever the committed state changed.
    """
    from trace_replay_core import replay_reference

    mismatches, forced, t_i, first = 0, 0, 0, None
    for k in range(len(got)):
        while t_i + 1 < len(tables) and tables[t_i + 1][0] <= k:
            t_i += 1
        _, tab, ln = tables[t_i]
        exp = replay_reference(base_all[k], idx_all[k], tab, ln, total_all[k], prompt)
        bad = int((np.asarray(got[k]) != exp).sum())
        if bad and first is None:
            first = (k, np.asarray(got[k]).tolist(), exp.tolist())
        mismatches += bad
        forced += int((exp != base_all[k]).sum())
    return mismatches, forced, first


def run_threads(worker, threads: int, *, timeout: float = 300.0) -> None:
    """Run ``worker(i)`` for ``i`` in ``range(threads)``, each on its own thread; wait for all.

    Re-raises the first exception a worker raised (the others are chained in the message), and
    fails when a worker did not return (still running after ``timeout`` seconds), so a test
    fails whenever the code under test raises on any thread.
    """
    errors: list[tuple[int, BaseException]] = []
    finished: set[int] = set()
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            worker(i)
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
            with lock:
                errors.append((i, exc))
        else:
            with lock:
                finished.add(i)

    ths = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout)
    if errors:
        i, first = errors[0]
        others = ", ".join(f"thread {j}: {type(e).__name__}: {e}" for j, e in errors[1:])
        raise AssertionError(
            f"thread {i} of {threads} raised {type(first).__name__}: {first}" + (f" (also {others})" if others else "")
        ) from first
    missing = sorted(set(range(threads)) - finished)
    assert not missing, f"threads {missing} of {threads} did not finish within {timeout} s"


def module_from_file(path) -> types.ModuleType:
    """The module in the file ``path`` (a script folder's, not a package's), loaded by its own
    spec: nothing is added to ``sys.path``, so its folder's other files stay unimportable. It
    sits in ``sys.modules`` only while it runs (dataclasses look it up there)."""
    path = pathlib.Path(path)
    name = f"_trace_replay_tests_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
