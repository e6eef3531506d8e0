"""What the JAX adapter refuses, or warns about, before it acts.

- Traced arguments to the state's eager methods (``state.replay`` inside ``jax.jit``) and
  traced or device-resident trace data given to staging.
- int64 numpy arrays whose values int32 cannot hold while ``jax_enable_x64`` is off: JAX turns
  such an array into int32 by keeping the low 32 bits, so a token id of ``2**32 + 5`` would be
  read as 5 and a slot of ``2**32 + 1`` as slot 1, silently.
- A replay asked for while writes are staged but not applied (:class:`StagedWrites`).

Every check here is host-only and reads no device memory.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from trace_replay_core import StagedWritesWarning

__all__ = [
    "StagedWrites",
    "check_fits_int32",
    "check_host",
    "refuse_traced",
    "is_vmap_tracer",
    "IN_JIT",
    "VMAP_MESSAGE",
]

VMAP_MESSAGE = (
    "trace_replay_jax.replay does not support jax.vmap: it already replays a whole batch. "
    "Call it on the batched arrays instead (fold the mapped axis into the batch axis: "
    "sampled and idx_mapping as [n * batch]), without vmap"
)


def is_vmap_tracer(x) -> bool:
    return type(x).__name__ == "BatchTracer"


IN_JIT = (
    "state.{name}() cannot be used inside jax.jit, lax loops or other transformations ({got}): "
    "pass state.tables into the jitted function as an argument and call "
    "trace_replay_jax.{name}(tables, ...) there"
)
TRACED_ARGS = "got traced arrays"
CONSTANT_ARGS = (
    "it was called while JAX traced a function, with constant arguments: the table would be "
    "compiled in as a constant and miss later apply_staged_writes()"
)


def refuse_traced(args, name: str) -> None:
    """Refuse ``state.<name>()`` on traced arrays (vmap first: it has its own message)."""
    traced = [a for a in args if isinstance(a, jax.core.Tracer)]
    if traced:
        if any(is_vmap_tracer(a) for a in traced):
            raise ValueError(VMAP_MESSAGE)
        raise ValueError(IN_JIT.format(name=name, got=TRACED_ARGS))


def check_host(trace, name: str, method: str) -> None:
    """Refuse trace data that is traced or lives on a device: staging reads host memory only."""
    if isinstance(trace, jax.core.Tracer):
        raise TypeError(
            f"{name} must be concrete host data; {method}() is host-only and cannot run "
            f"inside jax.jit or other transformations"
        )
    if isinstance(trace, jax.Array) and any(d.platform != "cpu" for d in trace.devices()):
        raise ValueError(
            f"{name} must be host data (a list, a numpy array or a CPU array); got a JAX "
            f"array on {sorted(str(d) for d in trace.devices())}: pass np.asarray({name}) "
            f"(a device-to-host copy you choose to make)"
        )


def check_fits_int32(x, name: str) -> None:
    """Refuse an int64 numpy array ``x`` holding a value int32 cannot hold, while
    ``jax_enable_x64`` is off (JAX would keep its low 32 bits). Anything else passes: a JAX
    array is already int32 without x64, and with x64 an int64 array stays int64."""
    if type(x) is not np.ndarray or x.dtype.itemsize != 8 or x.dtype.kind not in "iu" or not x.size:
        return
    if jax.config.jax_enable_x64:
        return
    flat = x.reshape(-1)
    bad = np.flatnonzero((flat < -(2**31)) | (flat > 2**31 - 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name} holds {int(flat[i])} at index {i}, which int32 cannot hold: with "
            f"jax_enable_x64 off JAX converts this {x.dtype} numpy array to int32 and would read "
            f"{int(flat[i : i + 1].astype(np.int32)[0])} instead; pass values that fit int32, or "
            f"enable x64 (jax.config.update('jax_enable_x64', True))"
        )


_STAGED = (
    "{what} while add_request/remove_request writes are staged but not applied: {effect} the "
    "traces of the last apply (a new trace is not replayed, a removed one still is). Call "
    "state.apply_staged_writes() first; TraceReplayState(..., strict=True) makes this an error"
)
_WHAT = {
    "replay": ("state.replay() ran", "it replays"),
    "replay_at_step": ("state.replay_at_step() ran", "it replays"),
    "tables": ("state.tables was read", "a replay with these tables replays"),
}


class StagedWrites:
    """Whether writes were staged since the last apply, and what a replay does about it.

    ``pending`` is a plain bool: set after a successful ``add_request``/``remove_request``/
    ``add_requests``, cleared by ``apply_staged_writes()``; the eager replays and the
    ``tables`` property read it and call :meth:`report` only when it is set. Host-only, no
    device work; one thread drives a JAX state at a time, so the flag is exact.
    """

    __slots__ = ("pending", "strict", "_warned")

    def __init__(self, strict: bool):
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False (got {strict!r})")
        self.pending = False
        self.strict = strict
        self._warned = False

    def report(self, call: str, stacklevel: int) -> None:
        """Raise ``RuntimeError`` (strict), else warn once per state with
        :class:`~trace_replay_core.StagedWritesWarning` at the caller ``stacklevel`` frames up
        (counted from the method that calls this)."""
        what, effect = _WHAT[call]
        message = _STAGED.format(what=what, effect=effect)
        if self.strict:
            raise RuntimeError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, StagedWritesWarning, stacklevel=stacklevel + 1)
