"""The peers the logprob benches time against, and the JAX wall-clock timer they share.

``torch_logprob_rank``: what a torch user writes (float32 ``log_softmax`` + ``gather`` + a ``>=``
count); ``make_jax_fns``: ``jax.jit`` of ``trace_replay_jax.token_logprob_rank`` per method;
``time_wall``: wall-clock us per call of a JAX function over back-to-back calls.
"""

from __future__ import annotations

import os
import time

from harness import percentiles

__all__ = ["torch_logprob_rank", "make_jax_fns", "time_wall"]


def torch_logprob_rank(logits, ids):
    """The naive torch version: float32 log-softmax over the vocabulary, gather, count."""
    import torch

    col = ids[:, None]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, col)[:, 0]
    ranks = (logits >= logits.gather(1, col)).sum(dim=-1)
    return logprobs, ranks


def make_jax_fns():
    """``({provider: jitted fn}, None)``, or ``({}, reason)`` when JAX has no GPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    try:
        import jax

        if not any(d.platform == "gpu" for d in jax.devices()):
            return {}, "jax sees no GPU"
        import trace_replay_jax
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the other providers still run
        return {}, f"jax unavailable: {exc}"
    fns = {}
    for method in trace_replay_jax.logprob.METHODS:
        fns[f"trace_replay_jax_{method}"] = jax.jit(
            lambda x, i, m=method: tuple(trace_replay_jax.token_logprob_rank(x, i, method=m))
        )
    return fns, None


def time_wall(fn, *, rounds: int = 9, budget_s: float = 0.04):
    """Wall-clock us per call: back-to-back calls, the last result blocked on per round."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    one = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(1000, max(5, budget_s / one)))
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return percentiles(per_round)
