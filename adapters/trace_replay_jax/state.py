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
  the old arrays. Cost: one copy of the table per apply that had staged writes. The state
  holds its copies weakly and deletes those still alive when it closes.
- Over a ``jax.sharding.Mesh`` (``mesh=``): one core table per local device of the mesh,
  every one staged with the same traces and committed on its own device's stream (the GPU)
  or copied (the CPU) by the same apply; ``tables`` are global arrays replicated over the
  mesh, assembled from the per-device arrays (zero-copy on a GPU). Staging costs one copy
  into each device's staging memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from trace_replay_core import TraceTable

from .devices import core_device, resolve_placement
from .guards import CONSTANT_ARGS, IN_JIT, StagedWrites, check_host, refuse_traced
from .jnp_replay import EAGER_ROWS, EAGER_SLOTS, ReplayTables, _check_method
from .kernel_replay import register_copies
from .tracing import refuse_under_trace

__all__ = ["TraceReplayState"]


class TraceReplayState:
    """Per-slot traces for a JAX decode loop, replayed onto the sampler's token ids.

    Parameters
    ----------
    max_slots, max_trace_len:
        Request slots of the loop (rows of ``idx_mapping`` point at them) and the longest trace.
    device:
        ``None`` (JAX's default device when the state is made: ``jax.default_device(...)`` or
        the ``jax_default_device`` setting, else the first local device), a ``jax.Device``,
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. The arrays given to replay must live on it (or
        be uncommitted); one on another device is refused, naming both.
    mesh:
        A ``jax.sharding.Mesh`` instead of ``device``: one core table per local device of the
        mesh, ``tables`` replicated over it. Replay then runs under ``jax.jit`` on arrays
        sharded over any mesh axis (XLA partitions the gather and select), or inside
        ``shard_map`` on each device's block (``P()`` for the tables).
    placement, vocab_size, staging_depth:
        As in :class:`trace_replay_core.TraceTable` (``placement`` applies on a GPU).
    strict:
        What happens when writes are staged but not applied (``add_request``/``remove_request``
        without :meth:`apply_staged_writes`) and the state is asked to replay (:meth:`replay`,
        :meth:`replay_at_step`) or for :attr:`tables` (what a jitted replay will read):
        ``False`` (default) warns once per state (:class:`~trace_replay_core.StagedWritesWarning`)
        and goes on with the traces of the last apply; ``True`` raises ``RuntimeError``. A
        host-side flag: a compiled program cannot check it, so a jitted step is checked where
        it gets its tables, at the read of :attr:`tables` (read them for every call: tables
        kept from an earlier read are not checked again).

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

    Blocking: construction and :meth:`close` are host-blocking; ``apply_staged_writes`` and
    ``replay`` are ordered with JAX's own work and never wait for the device. On a GPU,
    ``add_request``, ``add_requests``, ``remove_request``, :attr:`pending` and
    ``apply_staged_writes`` may block the host until XLA's thread has run the last apply's
    commit callback, which takes the staged writes (a trace staged sooner would leak into it;
    see ``commit.py``): a wait for XLA to dispatch the programs queued before that commit, not
    for the device to run it. One thread drives a state at a time.
    Ownership: the state owns the table (and on a GPU the memory behind :attr:`tables`); keep
    it alive while its tables are in use. Closing it deletes those arrays: on the CPU every
    copy an apply handed out, not only the latest (see :meth:`close`).
    """

    def __init__(
        self,
        max_slots: int,
        max_trace_len: int,
        *,
        device: Any = None,
        mesh: Any = None,
        placement: str = "device",
        vocab_size: int | None = None,
        staging_depth: int = 4,
        strict: bool = False,
    ):
        refuse_under_trace("TraceReplayState")
        self._staged = StagedWrites(strict)
        self.devices, self._sharding = resolve_placement(device, mesh)
        self.mesh = mesh
        self.device = self.devices[0] if mesh is None else None
        self._gpu = self.devices[0].platform == "gpu"
        self._cores: list[TraceTable] = []
        self._commits: list = []
        self._views: list[ReplayTables] = []
        self._copies: list[weakref.ref[jax.Array]] = []  # the CPU copies handed out, until close
        try:
            for d in self.devices:
                self._cores.append(
                    TraceTable(
                        max_slots,
                        max_trace_len,
                        device=core_device(d),
                        placement=placement,
                        vocab_size=vocab_size,
                        staging_depth=staging_depth,
                    )
                )
            self.table = self._cores[0]
            self.max_slots, self.max_trace_len = self.table.max_slots, self.table.max_trace_len
            if self._gpu:
                self._views = [self._gpu_views(core) for core in self._cores]
                self._tables = self._assemble(self._views)
            else:
                self._tables = self._cpu_copy()
        except BaseException:
            self._release()
            raise

    # construction ----------------------------------------------------------------------------
    def _gpu_views(self, core: TraceTable) -> ReplayTables:
        from .commit import XlaCommit
        from .kernel_replay import register_table
        from .views import table_views

        views = table_views(core)
        self._commits.append(XlaCommit(core))  # the core makes its context current itself
        register_table(core)
        return views

    def _assemble(self, per_device: Sequence[ReplayTables]) -> ReplayTables:
        """The tables of a single device as they are; over a mesh, global arrays replicated over
        it whose shard on each local device is that device's array (no copy)."""
        if self._sharding is None:
            return per_device[0]

        def glob(arrays):
            return jax.make_array_from_single_device_arrays(arrays[0].shape, self._sharding, list(arrays))

        return ReplayTables(glob([t.table for t in per_device]), glob([t.trace_len for t in per_device]))

    def _cpu_copy(self) -> ReplayTables:
        per_device = []
        for core, d in zip(self._cores, self.devices):
            table, trace_len = core.snapshot()  # fresh host copies, owned by nobody else
            copy = ReplayTables(jax.device_put(table, d), jax.device_put(trace_len, d))
            register_copies(core, copy.table)  # what method="kernel" accepts, as on a GPU
            per_device.append(copy)
        tables = self._assemble(per_device)
        self._copies = [ref for ref in self._copies if ref() is not None]
        self._copies += [weakref.ref(tables.table), weakref.ref(tables.trace_len)]
        return tables

    # lifetime --------------------------------------------------------------------------------
    @property
    def strict(self) -> bool:
        """Whether a replay with writes staged but not applied raises (else: warns once)."""
        return self._staged.strict

    @property
    def closed(self) -> bool:
        cores = getattr(self, "_cores", None)  # None: construction was refused before any table
        return not cores or cores[0].closed

    def _live(self) -> None:
        if self.closed:
            raise RuntimeError("this TraceReplayState is closed")

    def _wait(self) -> None:
        for commit in self._commits:
            commit.wait()

    def close(self) -> None:
        """Free the tables and staging memory. Host-blocking (waits for queued device work);
        idempotent. The arrays of :attr:`tables` are deleted (on a GPU they view freed memory;
        on the CPU every copy an apply handed out, held weakly until then, so that both refuse a
        closed state's tables alike). A program queued before with a CPU copy still reads it."""
        refuse_under_trace("close")
        self._release()

    def _release(self) -> None:
        if self.closed:
            return
        try:
            self._wait()
        finally:
            from .kernel_replay import unregister_table

            tables = getattr(self, "_tables", None)
            arrays = [tables.table, tables.trace_len] if tables is not None else []
            arrays += [a for v in self._views for a in (v.table, v.trace_len)]
            arrays += [ref() for ref in self._copies]  # on the CPU: every copy handed out, still alive
            for arr in arrays:
                if arr is not None and not arr.is_deleted():
                    arr.delete()
            self._copies = []
            for core in self._cores:
                unregister_table(core)
            self._commits = []
            for core in self._cores:
                core.close()

    def __del__(self):
        # Delete the views before the table's memory goes, so that a ReplayTables kept after its
        # state fails loudly ("Array has been deleted") instead of reading freed memory.
        try:
            self._release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: JAX or the driver may be gone
            pass

    def __enter__(self) -> TraceReplayState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # requests --------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Slots staged since the last :meth:`apply_staged_writes`. Host-only; on a GPU it may
        block the host until the last apply's commit has taken its writes (see Blocking above)."""
        refuse_under_trace("pending")
        self._live()
        self._wait()
        return self.table.pending

    def add_request(self, slot: int, trace: Sequence[int] | np.ndarray | jax.Array | None = None) -> None:
        """A request takes ``slot``: stage its trace, or mark the slot untraced (``trace=None``).

        ``trace``: host data (list of ints, numpy array, or a JAX array on the CPU), 1-D,
        non-empty, non-negative, at most ``max_trace_len`` long, below ``vocab_size`` when set;
        it is copied. Reusing a slot replaces whatever the previous request left there. Takes
        effect at the next :meth:`apply_staged_writes`. Host-only (refused under a JAX trace);
        a rejected call changes nothing. On a GPU it may block the host until the last apply's
        commit has taken its writes, so that this trace stays out of it (see Blocking above).
        """
        self._live()
        if trace is not None:
            check_host(trace, "trace", "add_request")
        refuse_under_trace("add_request")
        self._wait()
        # Every table holds the same traces: the first refuses bad input before any is changed.
        for core in self._cores:
            if trace is None:
                core.clear(slot)
            else:
                core.stage(slot, trace)
        self._staged.pending = True

    def add_requests(self, slots, traces) -> None:
        """Several requests take ``slots`` at once, each with a trace: one call instead of one
        :meth:`add_request` each, with the same result.

        ``traces``: a 2-D host array ``[len(slots), length]`` (numpy, or a JAX array on the CPU;
        the whole block is copied and checked in one pass), or a list of 1-D traces of any
        lengths. Each request takes its own slot: a slot given twice is refused (``ValueError``
        naming it and both positions). Takes effect at the next :meth:`apply_staged_writes`.
        Host-only (refused under a JAX trace); a rejected call changes nothing; on a GPU it may
        block the host as :meth:`add_request` does. See :meth:`trace_replay_core.TraceTable.stage_many`.
        """
        self._live()
        if isinstance(traces, (list, tuple)):
            for i, trace in enumerate(traces):
                check_host(trace, f"traces[{i}]", "add_requests")
        else:
            check_host(traces, "traces", "add_requests")
        refuse_under_trace("add_requests")
        self._wait()
        for core in self._cores:
            core.stage_many(slots, traces, distinct=True)
        self._staged.pending = True

    def remove_request(self, slot: int) -> None:
        """The request in ``slot`` finished: the slot becomes untraced at the next apply.
        Host-only (refused under a JAX trace); on a GPU it may block the host as
        :meth:`add_request` does."""
        refuse_under_trace("remove_request")
        self.add_request(slot, None)

    def apply_staged_writes(self) -> None:
        """Make everything staged visible to replays queued after this call; never waits for the device.

        On a GPU: one small jitted op per device that commits on XLA's stream (ordered after
        every JAX program queued before, and before every one queued after). On the CPU: a
        commit and a fresh copy of the table as :attr:`tables`. Does nothing when nothing was
        staged. Host-only: call it between jitted calls, never inside one (refused under a JAX
        trace, where it would run once at trace time and never again). On a GPU it may block
        the host until the last apply's commit has taken its writes (see Blocking above).
        """
        refuse_under_trace("apply_staged_writes")
        self._live()
        if self._gpu:
            self._wait()
            if self.table.pending:
                for commit, views in zip(self._commits, self._views):
                    commit(views.trace_len)
        elif self.table.pending:
            for core in self._cores:
                core.commit(stream=0)
            self._tables = self._cpu_copy()
        self._staged.pending = False

    # replay ----------------------------------------------------------------------------------
    @property
    def tables(self) -> ReplayTables:
        """The committed table as JAX arrays: pass it to jitted functions that replay.

        Read it after :meth:`apply_staged_writes` and pass it at every call (on the CPU each
        apply makes a new copy; on a GPU it is always the same pair of zero-copy views). Over a
        mesh: global arrays replicated over it. Never donate it. Read with writes staged but
        not applied, it warns once (``strict=True``: raises ``RuntimeError``): a jitted replay
        would not see them.
        """
        self._live()
        if self._staged.pending:
            self._staged.report("tables", stacklevel=2)
        return self._tables

    def snapshot(self):
        """Host copies ``(table, trace_len)`` of the table after every apply queued so far (the
        first device's, on a mesh: every device holds the same). Host-blocking (waits for the
        device): for tests and inspection, not for a step."""
        refuse_under_trace("snapshot")
        self._live()
        self._wait()
        return self.table.snapshot()

    def replay(
        self,
        sampled: jax.Array,
        idx_mapping: jax.Array,
        total_len: jax.Array,
        prompt_len: jax.Array,
        *,
        method: str = "jnp",
    ) -> jax.Array:
        """Return ``sampled`` with traced rows replaced (eager use; see :func:`trace_replay_jax.replay`).

        ``sampled``: ``[batch]`` or ``[batch, 1]`` int32/int64 token ids; ``idx_mapping``:
        ``[batch]`` slots (-1 = padding); ``total_len``/``prompt_len``: per-slot lengths (at
        least ``max_slots`` entries); ``method``: ``"jnp"`` or ``"kernel"``. One jitted
        dispatch, ordered with JAX's work, no host sync. Inside ``jax.jit`` use
        ``trace_replay_jax.replay(tables, ...)`` instead (refused here under any trace). With
        writes staged but not applied it warns once (``strict=True``: raises ``RuntimeError``).
        """
        refuse_traced((sampled, idx_mapping, total_len, prompt_len), "replay")
        _check_method(method)
        self._live()
        if self._staged.pending:
            self._staged.report("replay", stacklevel=2)
        tables = self._tables
        out = EAGER_SLOTS[method](tables.table, tables.trace_len, sampled, idx_mapping, total_len, prompt_len)
        if isinstance(out, jax.core.Tracer):  # called under a trace with constant arguments
            raise ValueError(IN_JIT.format(name="replay", got=CONSTANT_ARGS))
        return out

    def replay_at_step(
        self, sampled: jax.Array, idx_mapping: jax.Array, step: jax.Array, *, method: str = "jnp"
    ) -> jax.Array:
        """As :meth:`replay`, with ``step[b]`` (outputs already produced by row ``b``) per row."""
        refuse_traced((sampled, idx_mapping, step), "replay_at_step")
        _check_method(method)
        self._live()
        if self._staged.pending:
            self._staged.report("replay_at_step", stacklevel=2)
        tables = self._tables
        out = EAGER_ROWS[method](tables.table, tables.trace_len, sampled, idx_mapping, step)
        if isinstance(out, jax.core.Tracer):  # called under a trace with constant arguments
            raise ValueError(IN_JIT.format(name="replay_at_step", got=CONSTANT_ARGS))
        return out
