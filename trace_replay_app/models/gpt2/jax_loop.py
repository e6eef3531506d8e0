"""A reference decode loop of a small GPT-2-style model in JAX, replaying traces inside ``jax.jit``.

:func:`run_decode` decodes a list of :class:`~trace_replay_app.records.TraceRequest` with
a KV cache and continuous batching through slots, greedily (or by temperature sampling), and
forces traced requests onto their traces with :func:`trace_replay_jax.replay` inside the jitted
decode step; logprob and rank of every output token come from the unmodified logits through
:func:`trace_replay_jax.token_logprob_rank`, in the same program. The PyTorch twin
(``torch_loop.run_decode``) runs the same model on the same schedule
(:mod:`trace_replay_app.schedule`), so the two can be compared token by token. This module is
the only one of the family that imports JAX.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
    from trace_replay_app.records import TraceRequest
    from trace_replay_app.models.gpt2.jax_loop import run_decode

    config = GPT2Config()
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()

Compilation: two jitted programs, the decode step (one per ``config``, ``max_batch``, KV
length bucket and trace length bucket) and the admission of one request (one per prompt
length bucket besides those); buckets are powers of two, so a run compiles a handful of
programs and later runs of similar sizes reuse them, whatever their number of steps (outputs
are kept in fixed chunks of steps). Matrix products run at full precision of the compute dtype
(``precision="highest"``: no TF32 on GPUs), as in the PyTorch loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trace_replay_jax import ReplayTables, TraceReplayState, replay, resolve_device, token_logprob_rank

from ...records import RequestResult, TraceRequest
from ...schedule import check_device, check_run, check_sampling, collect_results, plan
from ..decode_buffers import bucket, fresh_outputs, prompt_prefix, run_chunks
from .config import GPT2Config, check_weights

__all__ = ["run_decode"]


class _Carry(NamedTuple):
    """Decode state that lives on the device between steps (donated to each step).

    ``cache``: ``[n_layer, 2 (keys, values), max_batch (slots), kv_len, n_head, head_dim]``
    in the compute dtype. ``prompt_len``/``total_len``: per slot, int32 (``total_len`` = prompt + tokens
    decoded so far). ``last``: the token each row feeds next. ``step``: the next step's index
    within the current chunk of ``CHUNK`` steps; ``t``: the next step's index in the run (the
    sampling noise of step ``t`` is drawn from ``fold_in(key, t)``). ``tokens``, ``argmax``, ``logprobs``,
    ``ranks``: that chunk's per-step outputs ``[CHUNK, max_batch]``.
    """

    cache: jax.Array
    prompt_len: jax.Array
    total_len: jax.Array
    last: jax.Array
    step: jax.Array
    t: jax.Array
    tokens: jax.Array
    argmax: jax.Array
    logprobs: jax.Array
    ranks: jax.Array


# -- the model ----------------------------------------------------------------------------------
_mm = functools.partial(jnp.matmul, precision="highest")
_einsum = functools.partial(jnp.einsum, precision="highest")


def _ln(p, x, name: str, eps: float):
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]


def _linear(p, x, name: str):
    return _mm(x, p[name + ".weight"]) + p[name + ".bias"]  # Conv1D: x @ W + b


def _layers(p, config: GPT2Config, x, attend, state):
    """The transformer blocks over ``x`` ``[tokens, n_embd]``. ``attend(layer, q, k, v, state)``
    (each of q, k, v ``[tokens, n_head, head_dim]``) returns the attention output and ``state``
    with this layer's keys and values stored; returns ``(x, state)``."""
    eps = config.layer_norm_epsilon
    for layer in range(config.n_layer):
        pre = f"h.{layer}."
        qkv = _linear(p, _ln(p, x, pre + "ln_1", eps), pre + "attn.c_attn")
        q, k, v = _split_heads(qkv, config)
        a, state = attend(layer, q, k, v, state)
        x = x + _linear(p, a.reshape(-1, config.n_embd), pre + "attn.c_proj")
        h = jax.nn.gelu(_linear(p, _ln(p, x, pre + "ln_2", eps), pre + "mlp.c_fc"), approximate=True)  # gelu_new
        x = x + _linear(p, h, pre + "mlp.c_proj")
    return x, state


def _split_heads(qkv, config: GPT2Config):
    """``[tokens, 3 * n_embd]`` -> q, k, v, each ``[tokens, n_head, head_dim]``."""
    q, k, v = jnp.split(qkv.reshape(-1, 3, config.n_head, config.head_dim), 3, axis=1)
    return q[:, 0], k[:, 0], v[:, 0]


def _embed(p, tokens, positions):
    return p["wte.weight"][tokens] + p["wpe.weight"][positions]


def _prefill(p, config: GPT2Config, cache, slot, tokens):
    """``cache`` with the keys and values of ``tokens`` (``[bucket]``, positions ``0 ..``) in ``slot``.

    Positions past the real prompt hold padding; each is overwritten by a decode step before
    any row reads it (a step writes its own position first, and attends to no later one).
    """
    n = tokens.shape[0]
    causal = jnp.tril(jnp.ones((n, n), dtype=bool))
    scale = 1.0 / math.sqrt(config.head_dim)

    def attend(layer, q, k, v, kv):
        scores = jnp.where(causal, _einsum("qhd,khd->hqk", q, k) * scale, -jnp.inf)
        return _einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v), kv + [jnp.stack([k, v])]

    _, kv = _layers(p, config, _embed(p, tokens, jnp.arange(n)), attend, [])
    update = jnp.stack(kv)[:, :, None]  # [n_layer, 2, 1 (slot), bucket, n_head, head_dim]
    return jax.lax.dynamic_update_slice(cache, update, (0, 0, slot, 0, 0, 0))


def _decode(p, config: GPT2Config, cache, tokens, positions):
    """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

    Returns ``(logits [max_batch, vocab] float32, cache)``. Rows attend to cache positions
    ``<= positions[b]``; an empty row computes garbage that no one reads.
    """
    rows = jnp.arange(tokens.shape[0])
    visible = (jnp.arange(cache.shape[3]) <= positions[:, None])[:, None, :]  # [rows, 1, kv_len]
    scale = 1.0 / math.sqrt(config.head_dim)

    def attend(layer, q, k, v, cache):
        cache = cache.at[layer, 0, rows, positions].set(k).at[layer, 1, rows, positions].set(v)
        scores = jnp.where(visible, _einsum("bhd,bthd->bht", q, cache[layer, 0]) * scale, -jnp.inf)
        return _einsum("bht,bthd->bhd", jax.nn.softmax(scores, axis=-1), cache[layer, 1]), cache

    h, cache = _layers(p, config, _embed(p, tokens, positions), attend, cache)
    return _mm(_ln(p, h, "ln_f", config.layer_norm_epsilon), p["wte.weight"].T).astype(jnp.float32), cache


# -- the two jitted programs --------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("carry",))
def _admit(params, carry: _Carry, slot, prefix, prompt_len, last, *, config: GPT2Config) -> _Carry:
    """A request joins ``slot``: prefill ``prefix`` (its prompt but the last token, padded to a
    bucket), set its lengths and the token it feeds first."""
    return carry._replace(
        cache=_prefill(params, config, carry.cache, slot, prefix),
        prompt_len=carry.prompt_len.at[slot].set(prompt_len),
        total_len=carry.total_len.at[slot].set(prompt_len),
        last=carry.last.at[slot].set(last),
    )


@functools.partial(jax.jit, static_argnames=("config", "sample"), donate_argnames=("carry",))
def _step(
    params, tables: ReplayTables, idx_chunk, carry: _Carry, key, temperature, *, config: GPT2Config, sample: bool
) -> _Carry:
    """One decode step of every row: logits, (sampling), replay, then one pass over the logits
    (:func:`trace_replay_jax.token_logprob_rank` with ``argmax=True``) for logprob, rank and the
    greedy token, append. Greedy: rows start at -1 ("not drawn"), replay writes the traced rows,
    the logprob call scores the -1 rows as their argmax, and those rows take it."""
    k = carry.step
    idx_mapping = idx_chunk[k]  # row -> slot, -1: empty row (this chunk's schedule)
    active = idx_mapping >= 0
    positions = jnp.where(active, carry.total_len - 1, 0)  # empty rows: anywhere in range
    logits, cache = _decode(params, config, carry.cache, carry.last, positions)
    drawn = jnp.full(idx_mapping.shape, -1, jnp.int32)  # greedy: the argmax, chosen below
    if sample:  # Gumbel-max over logits / temperature
        noise = jax.random.gumbel(jax.random.fold_in(key, carry.t), logits.shape, jnp.float32)
        drawn = jnp.argmax(logits / temperature + noise, axis=-1).astype(jnp.int32)
    sampled = replay(tables, drawn, idx_mapping, carry.total_len, carry.prompt_len)  # -1 rows stay -1
    # One read of the logits: logprob and rank of each row's token (a -1 row: of its argmax), and
    # the argmax (ties: the lowest id; NaN never chosen).
    logprobs, ranks, argmax = token_logprob_rank(logits, sampled, argmax=True)
    sampled = jnp.where(sampled < 0, argmax, sampled)
    return _Carry(
        cache=cache,
        prompt_len=carry.prompt_len,
        total_len=carry.total_len + active.astype(jnp.int32),
        last=jnp.where(active, sampled, carry.last),
        step=k + 1,
        t=carry.t + 1,
        tokens=carry.tokens.at[k].set(sampled),
        argmax=carry.argmax.at[k].set(argmax),
        logprobs=carry.logprobs.at[k].set(logprobs),
        ranks=carry.ranks.at[k].set(ranks.astype(jnp.int32)),
    )


# -- the loop -----------------------------------------------------------------------------------
def run_decode(
    config: GPT2Config,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
) -> list[RequestResult]:
    """Decode ``requests`` with the model ``config``/``weights``, replaying their traces.

    ``weights``: float numpy arrays named as in :func:`~trace_replay_app.models.gpt2.param_shapes`
    (copied to ``device`` in ``dtype``, ``"float32"`` or ``"bfloat16"``, the compute dtype; the
    caller's arrays are not changed). ``temperature``: 0 (default) decodes greedily; above 0,
    untraced rows sample from ``softmax(logits / temperature)`` (Gumbel-max, the noise of step
    ``t`` from ``jax.random.fold_in(jax.random.key(seed), t)``: the same arguments give the same
    tokens). ``requests``: each
    decodes ``request.new_tokens`` tokens; a traced one is forced onto its trace at every step.
    ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. ``max_batch``: slots (and batch rows)
    decoding at once; requests join in input order as slots free up (the schedule of
    :func:`trace_replay_app.schedule.plan`). ``on_step(k)`` is called on the host after
    each decode step is dispatched, with the number of tokens that step decodes.

    Returns one :class:`RequestResult` per request, in the order of ``requests``: the tokens
    (the trace for a traced request), ``forced`` (True inside the trace), the logprob and rank
    of each token under the unmodified float32 logits (before temperature), and the greedy
    ``argmax`` (ties: lowest id). Token ids are int32 on the device and int64 in the results.

    Each step is one jitted program (KV cache and outputs donated): logits, (sampling),
    ``trace_replay_jax.replay`` with ``state.tables`` passed in, logprob/rank/argmax in one read
    of the logits (greedy rows take the argmax), append; between
    steps, ``state.apply_staged_writes()`` makes the traces of newly admitted requests visible.
    Nothing waits for the device between steps; outputs stay on the device until one copy to
    the host at the end. Arguments are checked before anything runs (``TypeError`` /
    ``ValueError`` naming the argument); a rejected call does nothing.
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=GPT2Config, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    check_device(device)
    dev = resolve_device(device)  # ValueError when JAX has no such device
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        outputs = _decode_all(
            config, weights, prompts, traces, schedule, dev, on_step, jnp.dtype(dtype), temperature, seed
        )
    return collect_results(requests, schedule, outputs)


def _decode_all(
    config, weights, prompts, traces, schedule, dev, on_step, dtype, temperature, seed
) -> dict[str, np.ndarray]:
    """Run every step of ``schedule``; return the per-step outputs ``[n_steps, max_batch]`` on the host."""
    rows = schedule.max_batch
    kv_len = bucket(schedule.kv_positions([len(p) for p in prompts]), config.n_positions)
    put = functools.partial(jax.device_put, device=dev)
    params = put({name: np.asarray(w, dtype=np.float32) for name, w in weights.items()})
    if dtype != jnp.float32:
        params = jax.tree.map(lambda w: w.astype(dtype), params)
    key = put(jax.random.key(seed))
    temp = put(np.float32(temperature if temperature > 0 else 1.0))
    carry = put(
        _Carry(
            cache=jnp.zeros((config.n_layer, 2, rows, kv_len, config.n_head, config.head_dim), dtype),
            prompt_len=np.zeros(rows, np.int32),
            total_len=np.zeros(rows, np.int32),
            last=np.zeros(rows, np.int32),
            t=np.zeros((), np.int32),
            **fresh_outputs(rows),
        )
    )

    def admit(carry: _Carry, slot: int, prompt) -> _Carry:
        return _admit(
            params,
            carry,
            np.int32(slot),
            put(prompt_prefix(prompt, kv_len)),
            np.int32(len(prompt)),
            np.int32(prompt[-1]),
            config=config,
        )

    def step(carry: _Carry, tables: ReplayTables, idx_chunk) -> _Carry:
        return _step(params, tables, idx_chunk, carry, key, temp, config=config, sample=temperature > 0)

    # The table's shape is part of the step program's signature: bucket its row length too.
    max_trace = bucket(max((len(t) for t in traces if t is not None), default=1), config.n_positions)
    with TraceReplayState(rows, max_trace, device=dev, vocab_size=config.vocab_size) as state:
        return run_chunks(
            schedule,
            prompts,
            traces,
            state,
            carry,
            put=put,
            fetch=jax.device_get,
            admit=admit,
            step=step,
            on_step=on_step,
        )
