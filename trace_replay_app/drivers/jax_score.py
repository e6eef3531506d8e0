"""The JAX side of ``score`` (teacher-forced, :mod:`trace_replay_app.scoring`) for every family.

A family's :class:`~.jax_driver.JaxFamily` supplies ``hidden`` (final-norm hidden states of a
right-padded batch, causal, no cache) and ``logits`` (the output projection). Per batch, one
jitted program: ``hidden`` of the batch, the scored positions gathered, then the
output projection and :func:`trace_replay_jax.token_logprob_rank` over ``chunk`` of them at a
time in a ``lax.map`` (the logits of at most ``chunk`` positions exist at once). The scored
positions are padded to a power of two (and to a multiple of ``chunk``) so that batches of
similar sizes share a compiled program; the padding is scored and dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_replay_jax import resolve_device, token_logprob_rank

from ..records import RequestResult, TraceRequest
from ..scoring import ScorePlan, plan_score, score_results
from .jax_attention import attention_for
from .jax_driver import JaxFamily
from .jax_placement import device_params

__all__ = ["scorer", "score_batches"]


@functools.partial(jax.jit, static_argnames=("family", "config", "chunk", "attention", "temperature", "top_k"))
def _score(params, tokens, rows, targets, *, family: JaxFamily, config, chunk: int, attention: str = "xla",
           temperature: float | None = None, top_k: int = 0):  # fmt: skip
    """``(logprobs, ranks, argmax, entropy[, topk_logprobs, topk_ids])`` of ``targets`` ``[m]``
    under the logits of the flat positions ``rows`` ``[m]`` (``m`` a multiple of ``chunk``) of
    the sequences ``tokens``; the top-k pair ``[m, top_k]`` when ``top_k``."""
    hidden = family.hidden(params, config, tokens, attention)
    picked = hidden.reshape(-1, hidden.shape[-1])[rows]

    def one(args):
        h, ids = args
        temps = None if temperature is None else jnp.full(ids.shape, temperature, jnp.float32)
        out = token_logprob_rank(family.logits(params, h), ids, top_k=top_k, argmax=True, entropy=True,
                                 temperature=temps)  # fmt: skip
        return (out.logprobs, out.ranks, out.argmax, out.entropy) + ((out.topk_logprobs, out.topk_ids) if top_k else ())

    out = jax.lax.map(one, (picked.reshape(-1, chunk, picked.shape[-1]), targets.reshape(-1, chunk)))
    return tuple(o.reshape(-1, *o.shape[2:]) for o in out)


def score_batches(family: JaxFamily, config: Any, params: Any, plan: ScorePlan, device: Any) -> list[tuple]:
    """Each batch of ``plan`` through ``family`` with ``params`` (on ``device``, in the compute
    dtype): per batch ``(logprobs, ranks, argmax, entropy[, topk_logprobs, topk_ids])`` over its
    scored rows, on the host (host-blocking at the end)."""
    put = functools.partial(jax.device_put, device=device)
    # cuDNN's fused attention for bfloat16 on a GPU: jax.nn.dot_product_attention's default is
    # XLA's, which stores the [n, n] scores (133.7 against 13.7 ms for 24 layers at 64 x 1,024)
    attention = attention_for(device, plan.dtype)
    pending = []
    for batch in plan.batches:
        m = batch.rows.size
        padded = 1 << max(0, (m - 1).bit_length())
        chunk = min(plan.chunk_rows, padded)
        padded = -(-padded // chunk) * chunk
        rows = np.zeros(padded, np.int32)
        targets = np.zeros(padded, np.int32)
        rows[:m], targets[:m] = batch.rows, batch.targets
        out = _score(params, put(batch.tokens.astype(np.int32)), put(rows), put(targets), family=family,
                     config=config, chunk=chunk, attention=attention,
                     temperature=plan.logprob_temperature, top_k=plan.top_k)  # fmt: skip
        pending.append((m, out))
    return [tuple(np.asarray(o)[:m] for o in out) for m, out in pending]


def scorer(family: JaxFamily) -> Callable[..., list[RequestResult]]:
    """The ``run_score`` of ``family`` (the contract in :mod:`trace_replay_app.scoring`)."""

    def run_score(
        config: Any,
        weights: Mapping[str, np.ndarray],
        requests: Sequence[TraceRequest],
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_tokens: int = 16384,
        chunk_rows: int = 2048,
        logprobs_mode: str = "raw_logprobs",
        temperature: float = 1.0,
        top_k: int = 0,
    ) -> list[RequestResult]:
        plan = plan_score(config, weights, requests, device=device, dtype=dtype, max_tokens=max_tokens,
                          chunk_rows=chunk_rows, config_type=family.config_type,
                          check_weights=family.check_weights, logprobs_mode=logprobs_mode,
                          temperature=temperature, top_k=top_k)  # fmt: skip
        dev = resolve_device(device)
        outputs = score_batches(
            family, config, device_params(family, config, weights, dev, jnp.dtype(dtype)), plan, dev
        )
        return score_results(requests, plan, outputs)

    return run_score
