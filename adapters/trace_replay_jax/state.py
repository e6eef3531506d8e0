"""``TraceReplayState``: trace replay for a JAX decode loop, eager or inside ``jax.jit``.

Same state operations as the torch adapter (add a trace to a slot, apply staged writes,
replay), with JAX's rules: replay returns a new array, and inside a jitted program the table
arrives as an argument (:attr:`TraceReplayState.tables`).

Memory and ordering:

- The table lives in a :class:`trace_replay_core.TraceTable`, which owns it. On a GPU,
  ``tables`` are zero-copy JAX views of that device memory (DLPack, see ``views.py``), read
  by replay inside XLA programs; ``apply_staged_writes()`` commits on XLA's own compute
  stream from inside a jitted op (``commit.py``), so every program queued before it reads
  the old traces and every program queued after it the new ones, with no host sync.
- On the CPU, XLA programs run asynchronously and not necessarily in dispatch order, so
  stream order cannot protect an in-place write. There ``apply_staged_writes()`` commits to
  the numpy table and takes a fresh copy as the new ``tables``: programs already queued keep
  the old arrays. Cost: one copy of the table per apply that had staged writes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from trace_replay_core import TraceTable

from .jnp_replay import VMAP_MESSAGE, ReplayTables, eager_rows, eager_slots, is_vmap_tracer

__all__ = ["TraceReplayState"]


def _jax_device(device: Any) -> jax.Device:
    """``None`` (JAX's default device), a ``jax.Device``, ``"cpu"``, ``"cuda"``/``"gpu"`` or
    ``"cuda:N"``/``"gpu:N"`` (N = CUDA device ordinal) -> a ``jax.Device``."""
    if device is None:
        device = jax.devices()[0]
    elif isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "cuda", "gpu") or (index and not index.isdigit()) or (kind == "cpu" and index):
            raise ValueError(f"device must be a jax.Device, 'cpu', 'cuda', 'cuda:N' or None (got {device!r})")
        platform = "cpu" if kind == "cpu" else "gpu"
        try:
            devices = jax.devices(platform)
        except RuntimeError as exc:
            raise ValueError(f"device {device!r} is not available: JAX has no {platform} backend here "
                             f"({exc}); use device='cpu'") from exc
        if kind == "cpu":
            device = devices[0]
        else:
            wanted = int(index or 0)
            match = [d for d in devices if getattr(d, "local_hardware_id", d.id) == wanted]
            if not match:
                raise ValueError(f"device {device!r} is not available: JAX sees CUDA devices "
                                 f"{[getattr(d, 'local_hardware_id', d.id) for d in devices]}")
            device = match[0]
    elif not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device, 'cpu', 'cuda', 'cuda:N' or None "
                        f"(got {type(device).__name__})")
    if device.platform not in ("cpu", "gpu"):
        raise ValueError(f"device must be a CPU or CUDA GPU device (got {device.platform} device {device})")
    return device


def _refuse_traced(args, name: str) -> None:
    traced = [a for a in args if isinstance(a, jax.core.Tracer)]
    if traced:
        if any(is_vmap_tracer(a) for a in traced):
            raise ValueError(VMAP_MESSAGE)
        raise ValueError(_IN_JIT.format(name=name))


def _check_host(trace, name: str, method: str) -> None:
    """Refuse trace data that is traced or lives on a device: staging reads host memory only."""
    if isinstance(trace, jax.core.Tracer):
        raise TypeError(f"{name} must be concrete host data; {method}() is host-only and cannot run "
                        f"inside jax.jit or other transformations")
    if isinstance(trace, jax.Array) and any(d.platform != "cpu" for d in trace.devices()):
        raise ValueError(f"{name} must be host data (a list, a numpy array or a CPU array); got a JAX "
                         f"array on {sorted(str(d) for d in trace.devices())}: pass np.asarray({name}) "
                         f"(a device-to-host copy you choose to make)")


_IN_JIT = ("state.{name}() cannot be used inside jax.jit, lax loops or other transformations (got traced "
           "arrays): pass state.tables into the jitted function as an argument and call "
           "trace_replay_jax.{name}(tables, ...) there")


class TraceReplayState:
    """Per-slot traces for a JAX decode loop, replayed onto the sampler's token ids.

    Parameters
    ----------
    max_slots, max_trace_len:
        Request slots of the loop (rows of ``idx_mapping`` point at them) and the longest trace.
    device:
        ``None`` (JAX's default device), a ``jax.Device``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        The arrays given to replay must live on it.
    placement, vocab_size, staging_depth:
        As in :class:`trace_replay_core.TraceTable` (``placement`` applies on a GPU).

    Typical step, eager::

        state.add_request(slot, trace_token_ids)      # when a request joins (None: no trace)
        state.apply_staged_writes()                   # once per step, before replay
        sampled = sample(logits)                      # [batch] int32
        sampled = state.replay(sampled, idx_mapping, total_len, prompt_len)   # a new array

    Inside ``jax.jit`` (and ``lax.fori_loop``/``while_loop`` in it), pass the tables in::

        @jax.jit
        def step(params, tables, ...):
            ...
            return trace_replay_jax.replay(tables, sampled, idx_mapping, total_len, prompt_len)

        state.apply_staged_writes()
        out = step(params, state.tables, ...)

    Blocking: construction and :meth:`close` are host-blocking; ``add_request`` and
    ``remove_request`` are host-only; ``apply_staged_writes`` and ``replay`` are ordered with
    JAX's own work and never wait for the device. One thread drives a state at a time.
    Ownership: the state owns the table (and on a GPU the memory behind :attr:`tables`); keep
    it alive while its tables are in use. Closing it deletes those arrays.
    """

    def __init__(self, max_slots: int, max_trace_len: int, *, device: Any = None, placement: str = "device",
                 vocab_size: Optional[int] = None, staging_depth: int = 4):
        self.device = _jax_device(device)
        self._gpu = self.device.platform == "gpu"
        core_device = f"cuda:{self.device.local_hardware_id}" if self._gpu else "cpu"
        self.table = TraceTable(max_slots, max_trace_len, device=core_device, placement=placement,
                                vocab_size=vocab_size, staging_depth=staging_depth)
        self.max_slots, self.max_trace_len = self.table.max_slots, self.table.max_trace_len
        self._commit = None
        try:
            if self._gpu:
                self._tables = self._gpu_views()
            else:
                self._tables = self._cpu_copy()
        except BaseException:
            self.table.close()
            raise

    # construction ----------------------------------------------------------------------------
    def _gpu_views(self) -> ReplayTables:
        from .commit import XlaCommit
        from .views import jax_view
        # Compile the scatter kernel now (a no-op commit that clears slot 0, already clear), so
        # that the first commit inside XLA does not compile; then let every write land.
        self.table.clear(0)
        self.table.commit(stream=0)
        self.table.synchronize()
        table_view, lengths_view = self.table.device_views()
        try:
            table = jax_view(table_view)
        except Exception as exc:
            if self.table.placement != "host_mapped":
                raise
            raise ValueError(f"placement='host_mapped' is not usable with this JAX: it could not view the "
                             f"host-mapped table ({exc}); use placement='device'") from exc
        tables = ReplayTables(table, jax_view(lengths_view))
        self._commit = XlaCommit(self.table)   # the core makes its context current itself
        return tables

    def _cpu_copy(self) -> ReplayTables:
        table, trace_len = self.table.snapshot()    # fresh host copies, owned by nobody else
        return ReplayTables(jax.device_put(table, self.device), jax.device_put(trace_len, self.device))

    # lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.table.closed

    def _live(self) -> None:
        if self.table.closed:
            raise RuntimeError("this TraceReplayState is closed")

    def close(self) -> None:
        """Free the table and staging memory. Host-blocking (waits for queued device work);
        idempotent. The arrays of :attr:`tables` are deleted on a GPU (they view freed memory)."""
        if self.table.closed:
            return
        try:
            if self._commit is not None:
                self._commit.wait()
        finally:
            if self._gpu:
                for arr in (self._tables.table, self._tables.trace_len):
                    arr.delete()
            self._commit = None
            self.table.close()

    def __del__(self):
        # Delete the views before the table's memory goes, so that a ReplayTables kept after its
        # state fails loudly ("Array has been deleted") instead of reading freed memory.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: JAX or the driver may be gone
            pass

    def __enter__(self) -> "TraceReplayState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # requests --------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Slots staged since the last :meth:`apply_staged_writes`."""
        self._live()
        if self._commit is not None:
            self._commit.wait()
        return self.table.pending

    def add_request(self, slot: int, trace: Optional[Union[Sequence[int], np.ndarray, jax.Array]] = None) -> None:
        """A request takes ``slot``: stage its trace, or mark the slot untraced (``trace=None``).

        ``trace``: host data (list of ints, numpy array, or a JAX array on the CPU), 1-D,
        non-empty, non-negative, at most ``max_trace_len`` long, below ``vocab_size`` when set;
        it is copied. Reusing a slot replaces whatever the previous request left there. Takes
        effect at the next :meth:`apply_staged_writes`. Host-only; a rejected call changes
        nothing.
        """
        self._live()
        if self._commit is not None:
            self._commit.wait()
        if trace is None:
            self.table.clear(slot)
            return
        _check_host(trace, "trace", "add_request")
        self.table.stage(slot, trace)

    def add_requests(self, slots, traces) -> None:
        """Several requests take ``slots`` at once, each with a trace: one call instead of one
        :meth:`add_request` each, with the same result.

        ``traces``: a 2-D host array ``[len(slots), length]`` (numpy, or a JAX array on the CPU;
        the whole block is copied and checked in one pass), or a list of 1-D traces of any
        lengths. Takes effect at the next :meth:`apply_staged_writes`. Host-only; a rejected
        call changes nothing. See :meth:`trace_replay_core.TraceTable.stage_many`.
        """
        self._live()
        if self._commit is not None:
            self._commit.wait()
        if isinstance(traces, (list, tuple)):
            for i, trace in enumerate(traces):
                _check_host(trace, f"traces[{i}]", "add_requests")
        else:
            _check_host(traces, "traces", "add_requests")
        self.table.stage_many(slots, traces)

    def remove_request(self, slot: int) -> None:
        """The request in ``slot`` finished: the slot becomes untraced at the next apply."""
        self.add_request(slot, None)

    def apply_staged_writes(self) -> None:
        """Make everything staged visible to replays queued after this call; never waits for the device.

        On a GPU: one small jitted op that commits on XLA's stream (ordered after every JAX
        program queued before, and before every one queued after). On the CPU: a commit and a
        fresh copy of the table as :attr:`tables`. Does nothing when nothing was staged. Call
        it between jitted calls, never inside one.
        """
        self._live()
        if self._gpu:
            self._commit.wait()
            if self.table.pending:
                self._commit(self._tables.trace_len)
        elif self.table.pending:
            self.table.commit(stream=0)
            self._tables = self._cpu_copy()

    # replay ----------------------------------------------------------------------------------
    @property
    def tables(self) -> ReplayTables:
        """The committed table as JAX arrays: pass it to jitted functions that replay.

        Read it after :meth:`apply_staged_writes` and pass it at every call (on the CPU each
        apply makes a new copy; on a GPU it is always the same pair of zero-copy views). Never
        donate it.
        """
        self._live()
        return self._tables

    def snapshot(self):
        """Host copies ``(table, trace_len)`` of the table after every apply queued so far.
        Host-blocking (waits for the device): for tests and inspection, not for a step."""
        self._live()
        if self._commit is not None:
            self._commit.wait()
        return self.table.snapshot()

    def replay(self, sampled: jax.Array, idx_mapping: jax.Array, total_len: jax.Array,
               prompt_len: jax.Array) -> jax.Array:
        """Return ``sampled`` with traced rows replaced (eager use; see :func:`trace_replay_jax.replay`).

        ``sampled``: ``[batch]`` or ``[batch, 1]`` int32/int64 token ids; ``idx_mapping``:
        ``[batch]`` slots (-1 = padding); ``total_len``/``prompt_len``: per-slot lengths (at
        least ``max_slots`` entries). One jitted dispatch, ordered with JAX's work, no host
        sync. Inside ``jax.jit`` use ``trace_replay_jax.replay(tables, ...)`` instead.
        """
        _refuse_traced((sampled, idx_mapping, total_len, prompt_len), "replay")
        self._live()
        tables = self._tables
        return eager_slots(tables.table, tables.trace_len, sampled, idx_mapping, total_len, prompt_len)

    def replay_at_step(self, sampled: jax.Array, idx_mapping: jax.Array, step: jax.Array) -> jax.Array:
        """As :meth:`replay`, with ``step[b]`` (outputs already produced by row ``b``) per row."""
        _refuse_traced((sampled, idx_mapping, step), "replay_at_step")
        self._live()
        tables = self._tables
        return eager_rows(tables.table, tables.trace_len, sampled, idx_mapping, step)
