"""What replay and logprob/rank add to a greedy decode step, for ``bench/models.py``.

``replay_logprob_us`` times three versions of a step's sampler over ``[batch, vocab]`` bf16 logits
(torch: CUDA events over queued calls; JAX: 32 steps in one ``lax.fori_loop``, wall clock) so that
the bench can report the share of a decode step these calls take.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import time_cuda_queued  # noqa: E402


def replay_logprob_us(framework, batch, vocab, device):
    """What replay + logprob/rank add to a greedy step over ``[batch, vocab]`` bf16 logits (us of
    device time per step), half the rows traced. ``fused``: what the loops run, replay into ids of
    -1 and one ``token_logprob_rank(..., argmax=True)`` pass that also yields the greedy tokens;
    ``separate``: the loops' former step, an argmax pass, replay, then a logprob/rank pass;
    ``argmax``: the argmax pass alone, which a greedy step makes anyway. Returns the three times
    and ``added`` = fused - argmax (``added_separate`` = separate - argmax). torch: CUDA events
    over queued calls; JAX: 32 steps in one ``lax.fori_loop``, wall clock."""
    rng = np.random.default_rng(1)
    traces = rng.integers(0, vocab, (batch, 64))
    traced = list(range(0, batch, 2))
    if framework == "torch":
        import torch

        from trace_replay_torch import TraceReplayState, token_logprob_rank

        prompt_len = torch.full((batch,), 10, dtype=torch.int32, device=device)
        total_len = prompt_len + 3
        logits = torch.randn(batch, vocab, device=device).to(torch.bfloat16)
        sampled = torch.full((batch,), -1, dtype=torch.int64, device=device)
        idx = torch.arange(batch, dtype=torch.int32, device=device)
        out = (
            torch.empty(batch, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        )
        with TraceReplayState(batch, 64, device=device, total_len=total_len, prompt_len=prompt_len) as state:
            state.add_requests(traced, traces[traced])
            state.apply_staged_writes()

            def fused():
                sampled.fill_(-1)
                state.replay(sampled, idx)
                token_logprob_rank(logits, sampled, argmax=True, out=out)
                torch.where(sampled < 0, out[2], sampled, out=sampled)

            def separate():
                torch.argmax(logits, -1, out=sampled)
                state.replay(sampled, idx)
                token_logprob_rank(logits, sampled, out=out[:2])

            def argmax():
                torch.argmax(logits, -1, out=sampled)

            fns = {"fused": fused, "separate": separate, "argmax": argmax}
            if device != "cuda":
                for fn in fns.values():
                    fn()
                return {}
            times = {name: time_cuda_queued(fn)["us_p50"] for name, fn in fns.items()}
    else:
        import jax
        import jax.numpy as jnp

        import trace_replay_jax
        from trace_replay_jax import TraceReplayState

        dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        n_calls = 32
        with TraceReplayState(batch, 64, device=dev) as state:
            state.add_requests(traced, traces[traced])
            state.apply_staged_writes()
            put = lambda x: jax.device_put(x, dev)  # noqa: E731
            logits = put(jnp.asarray(rng.standard_normal((batch, vocab)), jnp.bfloat16))
            idx, prompt_len = put(np.arange(batch, dtype=np.int32)), put(np.full(batch, 10, np.int32))

            def loop_of(step):
                @jax.jit
                def loop(tables, logits, total_len):
                    def body(k, acc):
                        return acc + step(tables, logits, total_len + (k % 8))

                    return jax.lax.fori_loop(0, n_calls, body, jnp.float32(0))

                return loop

            def fused_step(tables, logits, total_len):
                tok = trace_replay_jax.replay(tables, jnp.full((batch,), -1, jnp.int32), idx, total_len, prompt_len)
                lp, rk, am = trace_replay_jax.token_logprob_rank(logits, tok, argmax=True)
                return lp.sum() + rk.sum() + jnp.where(tok < 0, am, tok).sum()

            def separate_step(tables, logits, total_len):
                tok = trace_replay_jax.replay(
                    tables, jnp.argmax(logits, -1).astype(jnp.int32), idx, total_len, prompt_len
                )
                lp, rk = trace_replay_jax.token_logprob_rank(logits, tok)
                return lp.sum() + rk.sum() + tok.sum()

            def argmax_step(tables, logits, total_len):
                return jnp.argmax(logits, -1).astype(jnp.float32).sum() + total_len[0]

            total_len = put(np.full(batch, 13, np.int32))
            times = {}
            for name, step in (("fused", fused_step), ("separate", separate_step), ("argmax", argmax_step)):
                loop = loop_of(step)
                fn = lambda loop=loop: loop(state.tables, logits, total_len)  # noqa: E731
                fn().block_until_ready()
                runs = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn().block_until_ready()
                    runs.append(time.perf_counter() - t0)
                times[name] = float(np.median(runs)) / n_calls * 1e6
    return dict(
        times,
        added=max(0.0, times["fused"] - times["argmax"]),
        added_separate=max(0.0, times["separate"] - times["argmax"]),
    )
