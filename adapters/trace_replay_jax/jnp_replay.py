"""Replay in ``jax.numpy``: one gather and one select that XLA fuses into the step around it.

The same semantics as the core's Triton kernel and its numpy reference, row by row:
``slot = idx_mapping[b]``; the row keeps the sampler's token when ``slot`` is outside
``[0, max_slots)``, when the slot has no trace (``trace_len[slot] <= 0``) or when the step is
outside ``[0, trace_len[slot])``; otherwise ``sampled[b] = table[slot, step]`` cast to
``sampled``'s dtype. The step is ``total_len[slot] - prompt_len[slot]`` computed exactly (no
integer wrap-around, as in the reference), or ``step[b]`` for :func:`replay_at_step`.

Both functions work eagerly (one jitted dispatch, never a host synchronisation) and inside
``jax.jit``, ``lax.fori_loop``, ``lax.while_loop`` and ``shard_map``. They return a new array
and never write into any input. ``jax.vmap`` is refused (replay already works on a whole
batch). ``method="kernel"`` runs the core's Triton kernel instead of the gather and select
(``kernel_replay.py``); the argument checks and the result are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from trace_replay_core import INDEX_DTYPES, TOKEN_DTYPES

from .guards import VMAP_MESSAGE, check_fits_int32, is_vmap_tracer
from .kernel_replay import kernel_replay

__all__ = ["ReplayTables", "replay", "replay_at_step", "METHODS", "VMAP_MESSAGE", "is_vmap_tracer"]

METHODS = ("jnp", "kernel")

_TOKEN_DTYPES = tuple(np.dtype(d) for d in TOKEN_DTYPES)
_INDEX_DTYPES = tuple(np.dtype(d) for d in INDEX_DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayTables:
    """The committed trace table as JAX arrays: what replay reads inside a jitted program.

    ``table``: ``[max_slots, max_trace_len]`` int32 trace tokens; ``trace_len``: ``[max_slots]``
    int32, 0 = untraced. A pytree: pass it as an argument of a jitted function (never close
    over it, never donate it). Get it from :attr:`TraceReplayState.tables` after
    :meth:`~TraceReplayState.apply_staged_writes`. On a GPU both arrays are zero-copy views of
    the table's device memory, owned by the state, and only JAX programs (which run on the
    stream commits are ordered on) see commits in order: for a host copy of the table use
    :meth:`~TraceReplayState.snapshot`, not ``np.asarray(tables.table)``. On the CPU they are a
    copy taken at each apply.
    """

    table: jax.Array
    trace_len: jax.Array


# -- argument checks (run at trace time: once per shape and dtype signature) --------------------
def _shape(x) -> list:
    return list(np.shape(x))


def _dtype(x: Any, name: str) -> np.dtype:
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise TypeError(f"{name} must be a JAX or numpy array (got {type(x).__name__})")
    return np.dtype(dt)


def _check_int(x: Any, name: str, allowed=_INDEX_DTYPES) -> None:
    dt = _dtype(x, name)
    check_fits_int32(x, name)  # a numpy constant inside the caller's jit
    if dt not in allowed:
        hint = ""
        if name == "sampled" and dt.kind in "fc":
            hint = (
                "; replay overwrites integer token ids and has no gradient: apply it to the "
                "sampler's token ids, outside jax.grad"
            )
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)} (got {dt}){hint}")


def _check_args(tables, sampled, idx_mapping, first, second, per_row: bool) -> int:
    table, trace_len = tables.table, tables.trace_len
    if _dtype(table, "tables.table") != np.int32 or np.ndim(table) != 2:
        raise TypeError(f"tables.table must be a 2-D int32 array (got {_dtype(table, 'tables.table')}{_shape(table)})")
    max_slots = np.shape(table)[0]
    if _dtype(trace_len, "tables.trace_len") != np.int32 or _shape(trace_len) != [max_slots]:
        raise TypeError(
            f"tables.trace_len must be int32[{max_slots}] (got "
            f"{_dtype(trace_len, 'tables.trace_len')}{_shape(trace_len)})"
        )
    _check_int(sampled, "sampled", _TOKEN_DTYPES)
    shape = _shape(sampled)
    if len(shape) == 2 and shape[1] != 1:
        raise ValueError(
            f"sampled has {shape[1]} tokens per row (shape {shape}): speculative decoding is "
            f"not supported; replay takes exactly one token per request per step"
        )
    if len(shape) not in (1, 2):
        raise ValueError(f"sampled must be 1-D [batch] or [batch, 1] (got shape {shape})")
    rows = shape[0]
    _check_int(idx_mapping, "idx_mapping")
    if _shape(idx_mapping) != [rows]:
        raise ValueError(f"idx_mapping must be 1-D with {rows} rows like sampled (got shape {_shape(idx_mapping)})")
    if per_row:
        _check_int(first, "step")
        if _shape(first) != [rows]:
            raise ValueError(f"step must be 1-D with {rows} rows like sampled (got shape {_shape(first)})")
        return rows
    for x, name in ((first, "total_len"), (second, "prompt_len")):
        _check_int(x, name)
        if np.ndim(x) != 1 or np.shape(x)[0] < max_slots:
            raise ValueError(f"{name} must be 1-D with at least max_slots={max_slots} entries (got shape {_shape(x)})")
    return rows


# -- the replay itself --------------------------------------------------------------------------
def _gather(x, index):
    return x.at[index].get(mode="promise_in_bounds")


def _rows(table, trace_len, sampled, idx_mapping, first, second):
    """Replayed copy of ``sampled``; ``second is None`` selects the per-row step mode."""
    max_slots = table.shape[0]
    flat = sampled.reshape(-1)
    active = (idx_mapping >= 0) & (idx_mapping < max_slots)
    slot = jnp.where(active, idx_mapping, 0)
    if second is None:
        step = first
        n = _gather(trace_len, slot)
        ok = active & (n > 0) & (step >= 0) & (step < n)
        step = jnp.where(ok, step, 0).astype(jnp.int32)
    else:
        # Per slot first (elementwise over max_slots, which XLA fuses into the gather below):
        # the step, or -1 where the slot has nothing to replay; then one gather per row. Fewer
        # gathers per row give XLA fewer fusions to launch (3 instead of 5 on the CPU backend).
        total, prompt = first[:max_slots], second[:max_slots]
        wide = jnp.promote_types(total.dtype, prompt.dtype)
        unsigned = jnp.uint64 if jnp.dtype(wide).itemsize == 8 else jnp.uint32
        total, prompt = total.astype(wide), prompt.astype(wide)
        # total - prompt in the unsigned type of the same width is exact whenever total >= prompt,
        # so no wrap-around can turn an absurd pair of lengths into a valid step.
        step = total.astype(unsigned) - prompt.astype(unsigned)
        live = (trace_len > 0) & (total >= prompt) & (step < trace_len.astype(unsigned))
        slot_step = jnp.where(live, step, -1).astype(jnp.int32)  # a live step is < trace_len: fits
        step = _gather(slot_step, slot)
        ok = active & (step >= 0)
        step = jnp.maximum(step, 0)
    token = table.at[slot, step].get(mode="promise_in_bounds")
    return jnp.where(ok, token.astype(flat.dtype), flat).reshape(sampled.shape)


def _refuse_vmap(axis_size, in_batched, *args):
    raise ValueError(VMAP_MESSAGE)


@custom_vmap
def _replay_slots(table, trace_len, sampled, idx_mapping, total_len, prompt_len):
    return _rows(table, trace_len, sampled, idx_mapping, total_len, prompt_len)


@custom_vmap
def _replay_rows(table, trace_len, sampled, idx_mapping, step):
    return _rows(table, trace_len, sampled, idx_mapping, step, None)


@custom_vmap
def _kernel_slots(table, trace_len, sampled, idx_mapping, total_len, prompt_len):
    return kernel_replay(table, trace_len, sampled, idx_mapping, total_len, prompt_len)


@custom_vmap
def _kernel_rows(table, trace_len, sampled, idx_mapping, step):
    return kernel_replay(table, trace_len, sampled, idx_mapping, step, None)


for _f in (_replay_slots, _replay_rows, _kernel_slots, _kernel_rows):
    _f.def_vmap(_refuse_vmap)

_SLOTS = {"jnp": _replay_slots, "kernel": _kernel_slots}
_ROWS = {"jnp": _replay_rows, "kernel": _kernel_rows}


def _check_method(method: Any) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")


def _traced_slots(tables, sampled, idx_mapping, total_len, prompt_len, method="jnp"):
    _check_args(tables, sampled, idx_mapping, total_len, prompt_len, per_row=False)
    return _SLOTS[method](tables.table, tables.trace_len, sampled, idx_mapping, total_len, prompt_len)


def _traced_rows(tables, sampled, idx_mapping, step, method="jnp"):
    _check_args(tables, sampled, idx_mapping, step, None, per_row=True)
    return _ROWS[method](tables.table, tables.trace_len, sampled, idx_mapping, step)


def _devices(x) -> str:
    devices = sorted(str(d) for d in x.devices())
    return devices[0] if len(devices) == 1 else str(devices)


def _check_devices(table, args, names) -> None:
    """After JAX refused to run the replay: name an argument committed to a device the tables
    are not on (JAX's own message names an internal lambda)."""
    if not isinstance(table, jax.Array) or isinstance(table, jax.core.Tracer):
        return
    home = table.devices()
    for x, name in zip(args, names):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed and x.devices() - home:
            raise ValueError(
                f"{name} is on {_devices(x)} but the state's tables are on {_devices(table)}: put "
                f"{name} on the state's device (jax.device_put({name}, state.device)) or create the "
                f"state on {name}'s (TraceReplayState(device=...); device=None takes JAX's default "
                f"device, jax.default_device(...) included)"
            )


def _eager(jitted, check, names):
    """``jitted`` for concrete arrays. Argument errors raised while JAX traces it carry JAX's
    traceback note; on failure the checks run again outside JAX to raise them plainly, and an
    argument on another device than the tables is named."""

    def call(table, trace_len, *args):
        for x, name in zip(args, names):
            if type(x) is np.ndarray:
                check_fits_int32(x, name)
        try:
            return jitted(table, trace_len, *args)
        except (TypeError, ValueError):
            check(ReplayTables(table, trace_len), *args)
            _check_devices(table, args, names)
            raise

    return call


def _check_slots(tables, s, i, tl, pl):
    _check_args(tables, s, i, tl, pl, per_row=False)


def _check_rows(tables, s, i, st):
    _check_args(tables, s, i, st, None, per_row=True)


def _jit_slots(method):
    return jax.jit(lambda table, trace_len, *args: _traced_slots(ReplayTables(table, trace_len), *args, method))


def _jit_rows(method):
    return jax.jit(lambda table, trace_len, *args: _traced_rows(ReplayTables(table, trace_len), *args, method))


# Eager entry points take the two table arrays as leaves: ~2 us less per call than a pytree.
_SLOT_NAMES = ("sampled", "idx_mapping", "total_len", "prompt_len")
_ROW_NAMES = ("sampled", "idx_mapping", "step")
EAGER_SLOTS = {m: _eager(_jit_slots(m), _check_slots, _SLOT_NAMES) for m in METHODS}
EAGER_ROWS = {m: _eager(_jit_rows(m), _check_rows, _ROW_NAMES) for m in METHODS}
eager_slots, eager_rows = EAGER_SLOTS["jnp"], EAGER_ROWS["jnp"]


_CLOSED_OVER = (
    "tables must be passed into the jitted function as an argument (got a concrete array while "
    "{why}): a closed-over table is compiled in as a constant and would miss later "
    "apply_staged_writes(); write jax.jit(step)(..., state.tables) and call replay(tables, ...) inside"
)


def _mode(tables, args) -> bool:
    """True when called under a trace (jit, loops, vmap), False when called eagerly."""
    if not isinstance(tables, ReplayTables):
        raise TypeError(f"tables must be a ReplayTables (state.tables) (got {type(tables).__name__})")
    traced = [a for a in args if isinstance(a, jax.core.Tracer)]
    if not traced:
        return False
    if not isinstance(tables.table, jax.core.Tracer) and not any(is_vmap_tracer(a) for a in traced):
        raise ValueError(_CLOSED_OVER.format(why="sampled/idx_mapping are traced"))
    return True


def _refuse_closed_over(out, tables) -> None:
    """Every argument was concrete, so the replay ran as an eager call: if that call was made
    while JAX traced an enclosing function (jit, a lax loop, shard_map), its result is a tracer
    and concrete tables were closed over: compiled in as a constant, they would replay the
    traces of this moment forever. One isinstance on the hot path."""
    if isinstance(out, jax.core.Tracer) and not isinstance(tables.table, jax.core.Tracer):
        raise ValueError(_CLOSED_OVER.format(why="JAX traces the function that calls replay"))


def replay(tables: ReplayTables, sampled, idx_mapping, total_len, prompt_len, *, method: str = "jnp") -> jax.Array:
    """Return ``sampled`` with every traced row replaced by its trace token for this step.

    ``tables``: :attr:`TraceReplayState.tables`. ``sampled``: ``[batch]`` or ``[batch, 1]``
    int32 (int64 with x64 enabled), the sampler's token ids. ``idx_mapping``: ``[batch]``
    int32/int64 slot of each row (-1: padding row, left alone). ``total_len``, ``prompt_len``:
    per-slot int32/int64 arrays with at least ``max_slots`` entries; a row's step is
    ``total_len[slot] - prompt_len[slot]`` (outputs already produced for that request).

    Returns a new array of ``sampled``'s shape and dtype; no input is written. Eagerly: one
    jitted dispatch, stream-ordered, no host synchronisation. Under ``jax.jit`` / loops: a
    gather and a select inside the compiled program; ``tables`` must then be an argument of the
    jitted function: concrete tables under a trace (closed over, or ``state.tables`` read
    inside it) are refused, whatever the other arguments, since they would be compiled in as
    a constant. Not differentiable (integer ids) and refused under ``jax.vmap``. With
    ``jax_enable_x64`` off, an int64 numpy argument holding a value int32 cannot hold is
    refused (JAX would keep its low 32 bits).

    ``method``: ``"jnp"`` (default: the gather and select, fused by XLA into the step) or
    ``"kernel"`` (the core's Triton replay kernel, launched by XLA on its stream through a
    command-buffer-compatible ``buffer_callback``; the core's numpy replay on the CPU). Both
    give the same tokens. ``"kernel"`` needs ``tables`` of an open :class:`TraceReplayState`
    (it reads that state's own table); on a mesh, call it inside ``shard_map``.
    """
    _check_method(method)
    if _mode(tables, (sampled, idx_mapping, total_len, prompt_len)):
        return _traced_slots(tables, sampled, idx_mapping, total_len, prompt_len, method)
    out = EAGER_SLOTS[method](tables.table, tables.trace_len, sampled, idx_mapping, total_len, prompt_len)
    _refuse_closed_over(out, tables)
    return out


def replay_at_step(tables: ReplayTables, sampled, idx_mapping, step, *, method: str = "jnp") -> jax.Array:
    """As :func:`replay`, with the step of each row given directly: ``step[b]`` (``[batch]``
    int32/int64, outputs already produced by row ``b``'s request)."""
    _check_method(method)
    if _mode(tables, (sampled, idx_mapping, step)):
        return _traced_rows(tables, sampled, idx_mapping, step, method)
    out = EAGER_ROWS[method](tables.table, tables.trace_len, sampled, idx_mapping, step)
    _refuse_closed_over(out, tables)
    return out
