"""Shared benchmark harness: provenance, timing helpers, result files.

- :func:`provenance` records where a result came from: GPU, driver, library versions, date, the
  command line, and the commit measured with a dirty flag (:func:`source_commit`).
- :func:`parse_args` gives every bench the same ``--help`` from its docstring.
- :func:`time_cuda` times device work with CUDA events (``triton.testing.do_bench``), after
  warm-up, and reports p20/p50/p80 in microseconds.
- :func:`time_host` times host-side cost per call (wall clock over back-to-back calls, no
  synchronisation inside the loop; the device is synchronised before and after), repeated in
  several rounds so that the spread is visible.
- :func:`write_results` writes ``bench/results/<name>.json``: rows, each with its provenance.
- :func:`rotating` cycles through prebuilt calls (different arrays, different table addresses),
  so that a timed loop does not measure the same cache lines over and over.
- :func:`copy_bandwidth` measures the copy ceilings of this machine in this run: device to
  device, pinned host to device, device to pinned host, and a host memcpy into pinned memory.
- :func:`bandwidth` turns time percentiles into GB/s percentiles for a byte count.

Benchmarks report figures; they never assert. Correctness lives in ``tests/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

__all__ = [
    "provenance",
    "source_commit",
    "parse_args",
    "time_cuda",
    "time_host",
    "percentiles",
    "write_results",
    "table",
    "RESULTS_DIR",
    "rotating",
    "bandwidth",
    "copy_bandwidth",
]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent or broken: recorded as such
        return None


COMMIT_ENV = "TRACE_REPLAY_COMMIT"
RESULTS_PATHSPEC = "bench/results"  # what benches write: not a change to the code measured
PROVENANCE_KEYS = ("gpu", "driver", "versions", "date", "command", "commit", "dirty")


def _git(root: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_commit(value: str) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` from the form ``TRACE_REPLAY_COMMIT`` takes: a commit hash, with
    ``-dirty`` appended when the tree had changes the commit lacks (as ``git describe
    --dirty`` writes it). An empty value says nothing: ``(None, None)``."""
    value = value.strip()
    if not value:
        return None, None
    if value.endswith("-dirty"):
        return value[: -len("-dirty")], True
    return value, False


def source_commit(root: str | None = None) -> tuple[str | None, bool | None]:
    """The commit this tree was checked out at, and whether it had changes: ``(commit, dirty)``.

    From ``git rev-parse HEAD`` and ``git status --porcelain`` (results files left out: the
    benches of one run write them) when ``root`` (default: this repository) is a git checkout;
    the environment variable ``TRACE_REPLAY_COMMIT`` (see :func:`parse_commit`) comes first when
    set, since a runner that ships a copy of the tree knows its commit better than a ``.git``
    that travelled with it (a copy may carry a stale one); else ``(None, None)``."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get(COMMIT_ENV, "").strip():  # set by whoever shipped the tree: it knows best
        return parse_commit(os.environ[COMMIT_ENV])
    if os.path.exists(os.path.join(root, ".git")):
        head = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--", ".", f":(exclude){RESULTS_PATHSPEC}")
        if head:
            return head.strip(), (bool(status.strip()) if status is not None else None)
    return parse_commit(os.environ.get(COMMIT_ENV, ""))


def provenance() -> dict[str, object]:
    """GPU name, driver, library versions, date (UTC), the command line of this run, and the
    commit measured with its dirty flag (:func:`source_commit`)."""
    gpu = driver = None
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()
        )
        if out:
            gpu, driver = [x.strip() for x in out[0].split(",")]
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi: CPU machine
        pass
    versions = {m: _version(m) for m in ("numpy", "torch", "triton", "jax", "jaxlib", "cuda.core", "cuda.bindings")}
    versions["python"] = platform.python_version()
    commit, dirty = source_commit()
    return {
        "gpu": gpu,
        "driver": driver,
        "versions": versions,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": commit,
        "dirty": dirty,
        "host": platform.node(),
    }


def parse_args(doc: str | None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse this bench's command line: ``--help`` prints ``doc`` (the script's docstring).
    Pass ``parser`` to add options of the script's own first."""
    parser = parser or argparse.ArgumentParser()
    parser.description = doc
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser.parse_args()


def percentiles(samples_us) -> dict[str, float]:
    a = np.asarray(samples_us, dtype=np.float64)
    p20, p50, p80 = np.percentile(a, [20, 50, 80])
    return {"us_p20": float(p20), "us_p50": float(p50), "us_p80": float(p80), "n": int(a.size)}


def time_cuda(fn: Callable[[], None], *, warmup_ms: float = 50, rep_ms: float = 300) -> dict[str, float]:
    """Device time of ``fn`` per call from CUDA events (``do_bench``): p20/p50/p80 in us."""
    from triton.testing import do_bench

    times_ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return percentiles(np.asarray(times_ms) * 1e3)


def time_cuda_queued(
    fn: Callable[[], None], *, calls: int = 20, rounds: int = 15, busy_cycles: int = 4_000_000
) -> dict[str, float]:
    """Device time per call of ``fn`` with the host's enqueue cost hidden: p20/p50/p80 in us.

    Per round: a ``torch.cuda._sleep`` kernel of ``busy_cycles`` clock cycles (about 2 ms on an
    H200) keeps the device busy while the host queues a start event, ``calls`` back-to-back
    calls and an end event; the events then time the calls back to back, as a decode loop
    whose host runs ahead would see them. L2 is not flushed: rotate the inputs (``rotating``)
    when a call's data would fit in L2. Falls back to :func:`time_cuda` without ``_sleep``.
    """
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return time_cuda(fn)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call, enqueue_us, busy_us = [], [], []
    for _ in range(rounds):
        before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        before.record()
        sleep(busy_cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueue_us.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        busy_us.append(before.elapsed_time(start) * 1e3)
        per_call.append(start.elapsed_time(end) * 1e3 / calls)
    # The host must have queued every call before the busy kernel ended, or host gaps are timed.
    stats = percentiles(per_call)
    stats.update(
        busy_us_min=float(min(busy_us)),
        enqueue_us_max=float(max(enqueue_us)),
        host_hidden=bool(max(enqueue_us) < min(busy_us)),
    )
    return stats


def time_host(
    fn: Callable[[], None], *, sync: Callable[[], None], calls: int = 2000, rounds: int = 15, warmup: int = 200
) -> dict[str, float]:
    """Host time per call of ``fn``: ``rounds`` rounds of ``calls`` back-to-back calls.

    The device is synchronised (``sync``) before each round, not inside it, so a GPU-bound call
    shows GPU time. Returns p20/p50/p80 over the per-round means, in us.
    """
    for _ in range(warmup):
        fn()
    sync()
    per_round = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        per_round.append((t1 - t0) / calls * 1e6)
    sync()
    return percentiles(per_round)


def write_results(name: str, rows: list[dict]) -> str:
    """Write ``results/<name>.json``: a list of ``rows``, each carrying its provenance (GPU,
    driver, versions, date, command, commit and dirty flag: :func:`provenance`). Return the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    prov = provenance()
    keep = {k: prov[k] for k in PROVENANCE_KEYS}
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump([dict(r, **keep) for r in rows], f, indent=1)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""

    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def rotating(fns: list[Callable[[], None]]) -> Callable[[], None]:
    """One callable that calls ``fns[0]``, ``fns[1]``, ... in turn, wrapping around."""
    it = itertools.cycle(list(fns))
    return lambda: next(it)()


def rows_same_bits(run_rows: Callable[[list], tuple], result: tuple, batch: int) -> bool:
    """Whether the batch's rows give the bits they have in ``result`` (torch tensors, one row per
    batch row; float32 compared as its int32 bits, so NaN equals the same NaN) when run in other
    batches: ``run_rows(rows)`` returns the outputs of the rows ``rows`` run together as one batch,
    in that order. Checked: every row at another position (the batch reversed), rows 0,
    ``batch // 2`` and ``batch - 1`` each alone, and up to 7 rows from ``batch // 3`` as a batch of
    their own (another batch size, another grid)."""
    import torch

    start = batch // 3
    batches = (
        [list(range(batch - 1, -1, -1))]
        + [[r] for r in sorted({0, batch // 2, batch - 1})]
        + [list(range(start, min(batch, start + 7)))]
    )
    for rows in batches:
        for a, b in zip(run_rows(rows), result):
            b = b[rows]
            if a.dtype == torch.float32:
                a, b = a.view(torch.int32), b.view(torch.int32)
            if not torch.equal(a, b):
                return False
    return True


def bandwidth(nbytes: int, stats: dict[str, float]) -> dict[str, float]:
    """GB/s (1 GB = 1e9 bytes) percentiles for ``nbytes`` moved in the time ``stats`` (us).

    Bandwidth falls as time rises: ``gbps_p20`` (the slow end) comes from ``us_p80``.
    """
    return {
        "gbps_p20": nbytes / stats["us_p80"] / 1e3,
        "gbps_p50": nbytes / stats["us_p50"] / 1e3,
        "gbps_p80": nbytes / stats["us_p20"] / 1e3,
    }


def copy_bandwidth(nbytes: int = 256 << 20, *, reps: int = 10, device: int = 0) -> dict[str, dict[str, float]]:
    """The copy ceilings of this machine, measured now with torch: ``{name: stats}``.

    - ``d2d``: device-to-device ``copy_`` of ``nbytes``; GB/s counts bytes read plus bytes
      written (``2 * nbytes``), the usual way to state memory bandwidth from a copy.
    - ``h2d_pinned``: pinned host to device, ``copy_(non_blocking=True)``; ``nbytes``.
    - ``d2h_pinned``: device to pinned host, the same way; ``nbytes``.
    - ``host_memcpy``: numpy ``copyto`` from ordinary (already touched) host memory into a
      numpy view of pinned memory, one thread; ``nbytes``.

    Device copies are timed with CUDA events on the current stream, the host copy with the wall
    clock; each after one warm-up copy, ``reps`` times. Each stats dict holds p20/p50/p80 in us,
    the bytes counted (``bytes``) and GB/s percentiles. Buffers are never zeros (a zero page can
    be cheaper to read).
    """
    import torch

    dev = torch.device("cuda", device)
    n_words = nbytes // 4
    src_host = np.arange(n_words, dtype=np.int32)
    src_host ^= 0x5A5A5A5A
    pinned = torch.empty(n_words, dtype=torch.int32, pin_memory=True)
    pinned_np = pinned.numpy()
    a = torch.from_numpy(src_host).to(dev)
    b = torch.empty_like(a)
    out: dict[str, dict[str, float]] = {}

    def events(copy) -> dict[str, float]:
        copy()
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return percentiles(times)

    np.copyto(pinned_np, src_host)
    for name, copy, moved in (
        ("d2d", lambda: b.copy_(a), 2 * nbytes),
        ("h2d_pinned", lambda: b.copy_(pinned, non_blocking=True), nbytes),
        ("d2h_pinned", lambda: pinned.copy_(a, non_blocking=True), nbytes),
    ):
        stats = events(copy)
        out[name] = dict(stats, bytes=moved, **bandwidth(moved, stats))

    np.copyto(pinned_np, src_host)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(pinned_np, src_host)
        times.append((time.perf_counter() - t0) * 1e6)
    stats = percentiles(times)
    out["host_memcpy"] = dict(stats, bytes=nbytes, **bandwidth(nbytes, stats))
    torch.cuda.synchronize(dev)
    return out
