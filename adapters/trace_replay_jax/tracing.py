"""Whether a call happens under a JAX trace (``jit``, loops, ``vmap``, ``grad``, ``shard_map``).

The state's host-only methods (staging, applying staged writes, snapshots, closing) act on
the host at the moment they are called. Under a trace they would run once, while JAX traces,
and never again when the compiled program runs; worse, a JAX op they make would hand a
tracer to the state (on the CPU, ``apply_staged_writes()`` would store one in
``state.tables`` and every later replay would fail). They are refused instead, by name, with
the fix.

The test reads JAX's current trace through ``jax.extend.core.get_opaque_trace_state`` (the
public, opaque handle other JAX libraries use for the same question) and compares it with the
top-level trace recorded at import: about 1 us, no device work.
"""

from __future__ import annotations

from jax.extend.core import get_opaque_trace_state

__all__ = ["refuse_under_trace"]

_TOP_LEVEL = get_opaque_trace_state()

_HOST_ONLY = {
    "add_request": "call it between jitted calls, on the host",
    "add_requests": "call it between jitted calls, on the host",
    "remove_request": "call it between jitted calls, on the host",
    "apply_staged_writes": (
        "call it between jitted calls, on the host, and pass state.tables into the next jitted call as an argument"
    ),
    "snapshot": "call it outside the traced function (it waits for the device and copies to the host)",
    "close": "close the state outside the traced function, after its last use",
    "pending": "read it between jitted calls, on the host",
    "TraceReplayState": "create the state outside the traced function and pass state.tables in as an argument",
}


def refuse_under_trace(method: str) -> None:
    """Raise ``RuntimeError`` naming ``method`` and its fix when called under a JAX trace."""
    if get_opaque_trace_state() != _TOP_LEVEL:
        name = method if method == "TraceReplayState" else f"state.{method}"
        call = f"{name}()" if method != "pending" else name
        raise RuntimeError(
            f"{call} is host-only and cannot run inside jax.jit, lax loops, vmap, grad or "
            f"shard_map (it was called while JAX was tracing): {_HOST_ONLY[method]}"
        )
