"""Logprob and rank of one token per row: this library's one-pass kernel vs torch vs jnp in jit.

Question: how close does ``token_logprob_rank`` come to the memory bandwidth, and how much
faster is it than the naive way, at vocab 151,936 and batch 1, 64, 256, 1024, for bfloat16
and float32 logits? Target (issue 5): at batch 256 the kernel reads the logits at >= 75% of the
measured device-to-device copy bandwidth and is >= 3x faster than the torch version.

Providers:
- ``trace_replay``: ``trace_replay_torch.token_logprob_rank(logits, ids, out=...)`` (one
  kernel; below batch 256 two: rows split over several programs, then a tiny combine; the
  adapter binds each tensor layout once, so a repeated call only launches).
- ``core_split512`` (batches below 512): the same kernels bound through the core with rows
  split until about 512 programs run (``SPLIT_TARGET_PROGRAMS = 512``; the library uses 256:
  one program per row from batch 256), the alternative measured against it.
- ``torch``: ``log_softmax`` in float32 + ``gather`` + comparison count (``>=``, summed).
- ``jax_jit``: ``jax.jit`` of ``log_softmax`` (float32) + ``take_along_axis`` + count.
- ``trace_replay_jax_kernel`` / ``trace_replay_jax_jnp``: ``jax.jit`` of
  ``trace_replay_jax.token_logprob_rank(logits, ids, method=...)``: the core kernel through a
  command-buffer-compatible ``buffer_callback`` on XLA's stream, or the same contract in jnp.

Timings (the ``timing`` field of every row):
- ``cuda events, queued behind a busy kernel`` (``harness.time_cuda_queued``; torch providers):
  20 back-to-back calls queued while a sleep kernel holds the device, so the host's enqueue
  cost is hidden, as in a decode loop whose host runs ahead; inputs rotate through copies of
  the logits (256 MiB in all, at most 32 copies, which the adapter's cache of bound calls
  keeps) so that L2 serves small batches less. The targets use this timing for both sides.
- ``cuda events (do_bench, L2 flushed)`` (``harness.time_cuda``): one call at a time after an
  L2 flush; a call whose host cost exceeds its device time shows the host cost here.
- ``host time per call`` (``trace_replay`` only): back-to-back calls, wall clock.
- JAX rows: wall clock per call over back-to-back calls of the jitted function on rotated
  copies, ``block_until_ready`` at the end of each round: device time when the device is the
  bottleneck, dispatch cost otherwise.

Reported: p20/p50/p80 in us and GB/s of logits read (``batch * vocab * itemsize / p50``; each
logit is read once by the kernel, several times by the others). The ceiling next to it:
``harness.copy_bandwidth()["d2d"]``, a 256 MiB device-to-device copy, as bytes moved (read +
written) per second.

Before timing, each provider's result is compared with the kernel's (ranks equal, largest
logprob difference) and the comparison is recorded in the rows.

Run: ``python bench/logprob_rank.py`` on a GPU; writes ``bench/results/logprob_rank.json``.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (bandwidth, copy_bandwidth, percentiles, provenance, rotating, table,  # noqa: E402
                     time_cuda, time_cuda_queued, time_host, write_results)

VOCAB = 151_936
BATCHES = (1, 64, 256, 1024)
DTYPES = ("bfloat16", "float32")
ROTATE_BYTES = 256 << 20          # timed loops cycle through copies of the logits this large in all
MAX_COPIES = 32                   # below the torch adapter's cache of bound calls (64 layouts)
QUEUED = "cuda events, queued behind a busy kernel"
DO_BENCH = "cuda events (do_bench, L2 flushed)"
HOST = "host time per call"
TARGET_BATCH = 256
SPLIT_OTHER = 512                 # another SPLIT_TARGET_PROGRAMS, measured next to the current one
TARGET_FRACTION = 0.75
TARGET_SPEEDUP = 3.0


def torch_logprob_rank(logits, ids):
    """The naive torch version: float32 log-softmax over the vocabulary, gather, count."""
    import torch
    col = ids[:, None]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, col)[:, 0]
    ranks = (logits >= logits.gather(1, col)).sum(dim=-1)
    return logprobs, ranks


def make_jax_fns():
    """``{provider: jitted fn}`` for the JAX providers, or ``({}, reason)`` when JAX has no GPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU with torch
    try:
        import jax
        if not any(d.platform == "gpu" for d in jax.devices()):
            return {}, "jax sees no GPU"
        import trace_replay_jax
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the other providers still run
        return {}, f"jax unavailable: {exc}"
    fns = {"jax_jit": jax.jit(jnp_logprob_rank)}
    for method in trace_replay_jax.logprob.METHODS:
        fns[f"trace_replay_jax_{method}"] = jax.jit(
            lambda x, i, m=method: trace_replay_jax.token_logprob_rank(x, i, method=m))
    return fns, None


def jnp_logprob_rank(logits, ids):
    """The jnp version: float32 log-softmax, take_along_axis, count."""
    import jax
    import jax.numpy as jnp
    col = ids[:, None]
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), col, axis=1)[:, 0]
    chosen = jnp.take_along_axis(logits, col, axis=1)
    ranks = jnp.sum(logits >= chosen, axis=-1)
    return logprobs, ranks


def split_target_bound(target, logits, ids, out):
    """A bound core call planned as if ``SPLIT_TARGET_PROGRAMS`` were ``target`` (bench only),
    with its own workspace; returns (bound call, workspace)."""
    import torch

    import trace_replay_core._logprob as core_logprob
    saved = core_logprob.SPLIT_TARGET_PROGRAMS
    core_logprob.SPLIT_TARGET_PROGRAMS = target
    try:
        nbytes = core_logprob.logprob_rank_workspace_bytes(*logits.shape)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=logits.device) if nbytes else None
        stream = torch.cuda.current_stream().cuda_stream
        bound = core_logprob.bind_logprob_rank(logits, ids, out_logprobs=out[0], out_ranks=out[1], workspace=ws,
                                               stream=stream)
    finally:
        core_logprob.SPLIT_TARGET_PROGRAMS = saved
    return bound, ws


def time_wall(fn, *, rounds: int = 15, budget_s: float = 0.05):
    """Wall-clock us per call: back-to-back calls, the last result blocked on per round."""
    import jax
    for _ in range(5):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    one = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(2000, max(10, budget_s / one)))
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return percentiles(per_round)


def compare(ref, got):
    """(ranks equal, largest |logprob difference|) between two (logprobs, ranks) results on host."""
    ref_lp, ref_rk = (np.asarray(a, dtype=np.float64) for a in ref)
    lp, rk = (np.asarray(a, dtype=np.float64) for a in got)
    return bool(np.array_equal(ref_rk, rk)), float(np.max(np.abs(ref_lp - lp)))


def main() -> None:
    import torch

    from trace_replay_core._logprob import SPLIT_TARGET_PROGRAMS

    from trace_replay_torch import token_logprob_rank

    if not torch.cuda.is_available():
        sys.exit("bench/logprob_rank.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []

    stream = torch.cuda.current_stream().cuda_stream
    copy = copy_bandwidth()["d2d"]
    copy_gbps = copy["gbps_p50"]
    rows.append(dict(copy, provider="d2d_copy", batch=None, vocab=None, dtype=None, gbps=copy_gbps,
                     timing="cuda events; GB/s counts bytes read + written"))
    print(f"device-to-device copy: p50 {copy['us_p50']:.1f} us = {copy_gbps:.0f} GB/s (read + write)", flush=True)

    jax_fns, jax_why = make_jax_fns()
    if not jax_fns:
        print(f"jax providers skipped: {jax_why}", flush=True)

    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for batch in BATCHES:
            logits = (torch.randn(batch, VOCAB, device=dev) * 4).to(dtype)
            ids = torch.randint(0, VOCAB, (batch,), device=dev)
            nbytes = logits.numel() * logits.element_size()
            n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
            copies = [logits] + [logits.clone() for _ in range(n_copies - 1)]
            out = (torch.empty(batch, device=dev), torch.empty(batch, dtype=torch.int64, device=dev))
            token_logprob_rank(logits, ids, out=out)                  # compiles the kernels
            ours = tuple(t.cpu().numpy() for t in out)
            naive = tuple(t.cpu().numpy() for t in torch_logprob_rank(logits, ids))
            base = dict(batch=batch, vocab=VOCAB, dtype=dtype_name, bytes=nbytes, copy_gbps=copy_gbps)

            def record(provider, timing, stats, result):
                same, diff = compare(ours, result) if result is not None else (True, 0.0)
                bw = bandwidth(nbytes, stats)
                rows.append(dict(base, provider=provider, timing=timing, gbps=bw["gbps_p50"],
                                 ranks_equal_to_kernel=same, max_abs_logprob_diff_to_kernel=diff, **stats, **bw))
                r = rows[-1]
                print(f"{provider:22s} {timing[:24]:24s} {dtype_name:9s} B={batch:5d} p50 {r['us_p50']:9.2f} us "
                      f"{r['gbps']:7.0f} GB/s  ranks equal: {same}, max |dlogprob| {diff:.2e}", flush=True)

            torch_providers = [
                ("trace_replay", lambda x: token_logprob_rank(x, ids, out=out), None),
                ("torch", lambda x: torch_logprob_rank(x, ids), naive),
            ]
            for name, fn, result in torch_providers:
                record(name, QUEUED, time_cuda_queued(rotating([lambda x=x: fn(x) for x in copies])), result)
                record(name, DO_BENCH, time_cuda(lambda: fn(logits)), result)
            if batch < max(SPLIT_TARGET_PROGRAMS, SPLIT_OTHER):
                # Another split setting, for comparison: bound core calls, one per copy.
                bounds = [split_target_bound(SPLIT_OTHER, x, ids, out) for x in copies]
                record(f"core_split{SPLIT_OTHER}", QUEUED,
                       time_cuda_queued(rotating([functools.partial(b, stream=stream) for b, _ in bounds])), None)
                del bounds
            host = time_host(lambda: token_logprob_rank(logits, ids, out=out), sync=torch.cuda.synchronize,
                             calls=200, rounds=9, warmup=50)
            rows.append(dict(base, provider="trace_replay", timing=HOST, **host))
            print(f"{'trace_replay':22s} {HOST[:24]:24s} {dtype_name:9s} B={batch:5d} p50 {host['us_p50']:9.2f} us",
                  flush=True)

            if jax_fns:
                import jax
                ids32 = ids.to(torch.int32)                   # JAX's default integer width
                torch.cuda.synchronize()
                xs_j = [jax.dlpack.from_dlpack(c) for c in copies]
                ids_j = jax.dlpack.from_dlpack(ids32)
                for name, fn in jax_fns.items():
                    result = tuple(np.asarray(a) for a in fn(xs_j[0], ids_j))
                    stats = time_wall(rotating([lambda x_j=x_j: fn(x_j, ids_j) for x_j in xs_j]))
                    record(name, f"wall clock incl. dispatch, {n_copies} copies rotated", stats, result)
                del xs_j, ids_j, ids32
            logits = ids = out = copies = None     # drop the references before the next size

    for dtype_name in DTYPES:
        def pick(provider, timing):
            return next(r for r in rows if r["provider"] == provider and r.get("timing") == timing
                        and r["batch"] == TARGET_BATCH and r["dtype"] == dtype_name)
        ours, naive = pick("trace_replay", QUEUED), pick("torch", QUEUED)
        fraction = ours["gbps"] / copy_gbps
        speedup = naive["us_p50"] / ours["us_p50"]
        rows.append(dict(provider="target", batch=TARGET_BATCH, vocab=VOCAB, dtype=dtype_name, timing=QUEUED,
                         fraction_of_copy=fraction, speedup_vs_torch=speedup,
                         met=bool(fraction >= TARGET_FRACTION and speedup >= TARGET_SPEEDUP)))

    path = write_results("logprob_rank", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    print(table([r for r in rows if r["provider"] not in ("target",)],
                ["provider", "timing", "dtype", "batch", "us_p50", "us_p20", "us_p80", "gbps"]))
    print(f"\ncopy ceiling: {copy_gbps:.0f} GB/s (read + write); JAX rows are wall clock incl. dispatch\n")
    print(table([r for r in rows if r["provider"] == "target"],
                ["dtype", "batch", "fraction_of_copy", "speedup_vs_torch", "met"]))


if __name__ == "__main__":
    main()
