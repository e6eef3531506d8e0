"""``TraceReplayState``: trace replay for a PyTorch decode loop.

Works on torch's current stream of the state's device, writes ``sampled`` in place, never
synchronises with the device, and can be captured in a CUDA graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch.autograd.graph import increment_version

from trace_replay_core import StagedWritesWarning, TraceTable, parse_device

from . import registry
from .views import FUNCTORCH_ACTIVE, layout_key, raw_stream

__all__ = ["TraceReplayState"]

_CLOSED = "this TraceReplayState is closed"
_STAGED = (
    "state.{call}() ran while add_request/remove_request writes are staged but not applied: it "
    "replays the traces of the last apply (a new trace is not replayed, a removed one still is). "
    "Call state.apply_staged_writes() before {call}; TraceReplayState(..., strict=True) makes this an error"
)


def _not_a_tensor(**arrays) -> TypeError | None:
    """A ``TypeError`` naming the first of ``arrays`` that is not a torch tensor, else None."""
    for name, value in arrays.items():
        if not isinstance(value, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor (got {type(value).__name__})")
    return None


def _check_host(trace, name: str) -> None:
    """Refuse trace data that lives on a device (staging reads host memory only), and tensors
    that are not integer token ids (a float tensor that requires grad cannot even be exported)."""
    if isinstance(trace, torch.Tensor):
        if trace.device.type != "cpu":
            raise ValueError(
                f"{name} must be host data (list, numpy array or CPU tensor); got a tensor on "
                f"{trace.device}: pass {name}.cpu() (a host sync you choose to make)"
            )
        if trace.dtype.is_floating_point or trace.dtype.is_complex or trace.dtype == torch.bool:
            grad = ", which requires grad" if trace.requires_grad else ""
            raise TypeError(
                f"{name} must hold integer token ids (got a {trace.dtype} tensor{grad}): pass the "
                f"sampled or recorded ids as an integer tensor"
            )


class TraceReplayState:
    """Per-slot traces for a PyTorch decode loop, replayed onto the sampler's output.

    Parameters
    ----------
    max_slots, max_trace_len:
        Request slots of the loop (rows of ``idx_mapping`` point at them) and the longest trace.
    device:
        ``torch.device`` or string; ``"cpu"`` uses the numpy backend.
    total_len, prompt_len:
        Optional per-slot length tensors (int32/int64, at least ``max_slots`` entries, on
        ``device``) that the loop keeps up to date; bound once here so that each step only
        hands over ``sampled`` and ``idx_mapping``. The state reads them on the device at replay
        time and keeps references to them. Rebind with :meth:`bind_lengths`.
    placement, vocab_size, staging_depth:
        As in :class:`trace_replay_core.TraceTable`.
    strict:
        What :meth:`replay` and :meth:`replay_at_step` do when writes are staged but not yet
        applied (``add_request``/``remove_request`` without :meth:`apply_staged_writes`):
        ``False`` (default) warns once per state (:class:`~trace_replay_core.StagedWritesWarning`)
        and replays the traces of the last apply; ``True`` raises ``RuntimeError`` instead. A
        host-side flag, read when replay is called from Python: a CUDA graph replays without
        it (apply before ``graph.replay()``).

    The length tensors are read by reference: update them in place (``total_len[idx] += 1``,
    ``total_len.copy_(...)``); a name rebound to a new tensor (``total_len = total_len + 1``)
    leaves the state reading the old one (rebind with :meth:`bind_lengths`).

    Typical step::

        state.add_request(slot, trace_token_ids)   # when a request joins (None: no trace)
        state.apply_staged_writes()                # once per step, before replay
        sampled = sampler(logits)                  # [batch] int64
        state.replay(sampled, idx_mapping)         # in place, current stream
        logprobs, ranks = ... (logits, sampled)    # from the unmodified logits

    Blocking: ``add_request``/``remove_request`` are host-only; ``apply_staged_writes`` and
    ``replay`` are ordered on the current stream and never synchronise. The first replay of a
    dtype combination compiles a kernel: run one eager step before capturing a CUDA graph.

    Inside ``torch.compile`` the methods compile as they are: they become the registered ops,
    which name this state by :attr:`op_id` (the ``*_op`` functions call those ops directly; optional).

    Lifetime: :meth:`close` (or leaving the ``with`` block) frees the table; afterwards every
    method raises ``RuntimeError("this TraceReplayState is closed")``. A CUDA graph captured with
    a replay holds the table's device address, not the state: never replay it after close.
    Staging methods are thread-safe (the table's lock); ``close`` must not race with a replay.
    """

    def __init__(
        self,
        max_slots: int,
        max_trace_len: int,
        *,
        device: str | torch.device,
        total_len: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
        placement: str = "device",
        vocab_size: int | None = None,
        staging_depth: int = 4,
        strict: bool = False,
    ):
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False (got {strict!r})")
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a cpu or cuda device (got {device})")
        if device.type == "cuda":
            parse_device(str(device))  # the core's check: the same error for "cuda" and "cuda:N"
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        if (total_len is None) != (prompt_len is None):
            raise ValueError("give both total_len and prompt_len, or neither")
        self.device = device
        self._index = device.index if device.type == "cuda" else None
        self._closed = False
        self._lengths: tuple[torch.Tensor, torch.Tensor] | None = None  # the bound tensors
        self._strict = strict
        self._unapplied = False  # set after staging, cleared before a commit: replay's one check
        self._warned = self._warning_unsettled = False  # unsettled: given to a replay not yet checked
        self.table = TraceTable(
            max_slots,
            max_trace_len,
            device=str(device),
            placement=placement,
            vocab_size=vocab_size,
            staging_depth=staging_depth,
        )
        if total_len is not None:
            try:
                self.bind_lengths(total_len, prompt_len)
            except Exception:
                self.table.close()
                raise
        self._op_id = registry.register(self)

    # streams ---------------------------------------------------------------------------------
    def _stream(self) -> int:
        return raw_stream(self._index) if self._index is not None else 0

    # lifetime --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def op_id(self) -> int:
        """The int that names this state in the registered ops (``torch.ops.trace_replay.*``):
        unique in the process, never reused; looked up in :mod:`.registry` while open."""
        return self._op_id

    @property
    def strict(self) -> bool:
        """Whether a replay with writes staged but not applied raises (else: warns once)."""
        return self._strict

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(_CLOSED)

    def _check_open_unless_tracing(self) -> None:
        """:meth:`_check_open`, except while ``torch.compile`` traces: the op refuses a closed state
        when the graph runs (same message); Dynamo would report a traced raise wrapped in its own
        error, and a guard on ``closed`` would retrace the function at every close."""
        if not torch.compiler.is_compiling():
            self._check_open()

    def _staged_not_applied(self, call: str, stacklevel: int = 3) -> None:
        """A replay found writes staged and not applied: warn once per state (a refused replay gives
        it back), or raise when strict. Host-only; called only when replay's one bool is set."""
        self._check_open()
        self._warning_unsettled = False  # the replay that took it was not refused: it ran
        if not self.table.pending:  # another thread applied them after staging set the flag
            return
        if self._strict:
            raise RuntimeError(_STAGED.format(call=call))
        if not self._warned:
            warnings.warn(_STAGED.format(call=call), StagedWritesWarning, stacklevel=stacklevel)
            self._warned = self._warning_unsettled = True  # after warn: one raised as an error is not used up

    def close(self) -> None:
        """Free the table and staging memory (host-blocking: waits for queued device work;
        idempotent). The state leaves the op registry first, so no op reaches it afterwards."""
        if self._closed:
            return
        self._closed = True
        self._unapplied = False
        registry.unregister(self._op_id)
        # The bound lengths stay: a compiled function guards on them, so it keeps its graph and
        # the op refuses the closed state when the graph runs (a clear error, not a retrace).
        self.table.close()

    def __enter__(self) -> TraceReplayState:
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # requests --------------------------------------------------------------------------------
    def add_request(self, slot: int, trace: Sequence[int] | torch.Tensor | None = None) -> None:
        """A request takes ``slot``: stage its trace, or mark the slot untraced (``trace=None``).

        ``trace`` is host data (list of ints, numpy array or CPU tensor). Reusing a slot always
        replaces whatever the previous request left there. Takes effect at the next
        :meth:`apply_staged_writes`. Host-only; a rejected call changes nothing.
        """
        self._check_open()
        if trace is None:
            self.table.clear(slot)
        else:
            _check_host(trace, "trace")
            self.table.stage(slot, trace)
        self._unapplied = True

    def add_requests(self, slots, traces) -> None:
        """Several requests take ``slots`` at once, each with a trace: one call instead of one
        :meth:`add_request` each, with the same result.

        ``traces``: a 2-D host array or CPU tensor ``[len(slots), length]`` (the whole block is
        copied and checked in one pass: the fast way to admit many requests in one step), or a
        list of 1-D traces of any lengths. Each request takes its own slot: a slot given twice is
        refused (``ValueError`` naming it and both positions). Host-only; a rejected call changes
        nothing. See :meth:`trace_replay_core.TraceTable.stage_many`.
        """
        self._check_open()
        if isinstance(traces, (list, tuple)):
            for i, trace in enumerate(traces):
                _check_host(trace, f"traces[{i}]")
        else:
            _check_host(traces, "traces")
        if isinstance(slots, torch.Tensor):
            _check_host(slots, "slots")
        self.table.stage_many(slots, traces, distinct=True)
        self._unapplied = True

    def remove_request(self, slot: int) -> None:
        """The request in ``slot`` finished: the slot becomes untraced at the next apply."""
        self._check_open()
        self.table.clear(slot)
        self._unapplied = True

    def apply_staged_writes(self) -> None:
        """Commit staged traces to the table, ordered on the current stream (no host sync).

        Call it once per step before :meth:`replay`, outside any CUDA graph capture.
        """
        self._check_open()
        # Cleared before the commit: a trace another thread stages meanwhile sets it again.
        self._unapplied = False
        self._warning_unsettled = False
        try:
            self.table.commit(stream=self._stream())
        except BaseException:
            self._unapplied = True
            raise

    # lengths ---------------------------------------------------------------------------------
    def bind_lengths(self, total_len: torch.Tensor, prompt_len: torch.Tensor) -> None:
        """Bind the per-slot length tensors read by :meth:`replay` (validated here, once; see
        :meth:`trace_replay_core.TraceTable.bind_lengths`). The state keeps references to them."""
        self._check_open()
        error = _not_a_tensor(total_len=total_len, prompt_len=prompt_len)
        if error is not None:
            raise error
        self.table.bind_lengths(total_len, prompt_len, stream=self._stream())
        self._lengths = (total_len, prompt_len)

    def _bound_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound ``(total_len, prompt_len)``, for the registered ops' wrappers. While
        ``torch.compile`` traces, a closed state is not refused here but by the op when the graph
        runs (the same message, from the compiled function rather than from inside the tracer)."""
        self._check_open_unless_tracing()
        if self._lengths is None:
            raise ValueError("total_len and prompt_len were neither given nor bound (see bind_lengths)")
        return self._lengths

    # replay ----------------------------------------------------------------------------------
    def replay(
        self,
        sampled: torch.Tensor,
        idx_mapping: torch.Tensor,
        total_len: torch.Tensor | None = None,
        prompt_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Overwrite traced rows of ``sampled`` in place on the current stream; return it.

        ``sampled``: ``[batch]`` or ``[batch, 1]`` int32/int64; ``idx_mapping``: ``[batch]``
        int32/int64 slots (-1 = padding); ``total_len``/``prompt_len`` default to the bound ones.
        Each contiguous and on the state's device (else refused, never copied). Stream-ordered,
        no host sync; capturable in a CUDA graph once warmed up. With writes staged but not
        applied it warns once (``strict=True``: raises ``RuntimeError``; a refused call does not
        use up the warning). Bumps ``sampled``'s version counter as torch's in-place ops do: a
        backward through a tensor autograd saved before (``logits.gather(1, sampled[:, None])``)
        raises instead of using the replayed tokens. ``torch.vmap`` is refused: fold the mapped
        axis into the batch. Compiles as it is: inside ``torch.compile`` it becomes the registered
        op (:func:`~trace_replay_torch.replay_op`), whose kernel makes the staged-writes check
        each time the compiled code runs (a CUDA graph replays without it).
        """
        if torch.compiler.is_compiling():
            from .ops import replay_op  # a graph holds the registered op, never this method's Python

            return replay_op(self, sampled, idx_mapping, total_len, prompt_len)
        if total_len is not None or prompt_len is not None:
            self._check_open()
            if total_len is None or prompt_len is None:
                raise ValueError("give both total_len and prompt_len, or neither (to use the bound ones)")
            error = _not_a_tensor(sampled=sampled, idx_mapping=idx_mapping, total_len=total_len, prompt_len=prompt_len)
            if error is not None:
                raise error
            return self._replay_checked("replay", sampled, idx_mapping, lengths=(total_len, prompt_len))
        if self._unapplied:
            self._staged_not_applied("replay")
        # The hot path of a decode loop: one flat key, one dict lookup, one launch (in the core).
        # Nothing is checked before the launch; a failure is explained afterwards (closed first:
        # closing clears the table's cache, so a closed state always reaches the except clause).
        try:
            key = (
                sampled.data_ptr(),
                sampled.dtype,
                sampled.shape,
                sampled.stride(),
                idx_mapping.data_ptr(),
                idx_mapping.dtype,
                idx_mapping.shape,
                idx_mapping.stride(),
            )
            self.table.replay_cached(
                key, sampled, idx_mapping, stream=raw_stream(self._index) if self._index is not None else 0
            )
        except Exception as exc:
            return self._replay_refused(exc, "replay", sampled, idx_mapping)
        increment_version(sampled)  # written through its pointer: tell autograd, as an in-place op does
        return sampled

    def replay_at_step(self, sampled: torch.Tensor, idx_mapping: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """As :meth:`replay`, with ``step[b]`` (outputs already produced by row ``b``) given per row:
        ``step`` is a contiguous ``[batch]`` int32/int64 tensor on the state's device. Compiles as
        it is (the registered op :func:`~trace_replay_torch.replay_at_step_op`)."""
        if torch.compiler.is_compiling():
            from .ops import replay_at_step_op

            return replay_at_step_op(self, sampled, idx_mapping, step)
        self._check_open()
        error = _not_a_tensor(sampled=sampled, idx_mapping=idx_mapping, step=step)
        if error is not None:
            raise error
        return self._replay_checked("replay_at_step", sampled, idx_mapping, step=step)

    def _replay_checked(self, call: str, sampled, idx_mapping, lengths=None, step=None) -> torch.Tensor:
        """A replay with explicit lengths or per-row steps, its arguments checked to be tensors."""
        if self._unapplied:
            self._staged_not_applied(call, stacklevel=4)
        try:
            if step is None:
                key = tuple(layout_key(t) for t in (sampled, idx_mapping, *lengths))
                self.table.replay_cached(key, sampled, idx_mapping, *lengths, stream=self._stream())
            else:
                key = ("step", layout_key(sampled), layout_key(idx_mapping), layout_key(step))
                self.table.replay_cached(key, sampled, idx_mapping, step=step, stream=self._stream())
        except Exception as exc:
            return self._replay_refused(exc, call, sampled, idx_mapping, lengths, step)
        increment_version(sampled)
        return sampled

    def _replay_refused(self, exc: Exception, call: str, sampled, idx_mapping, lengths=None, step=None):
        """A replay failed before it launched: under ``torch.func`` transforms (tensors without storage)
        run the registered op, which has rules for them; else raise what explains it best."""
        try:
            if FUNCTORCH_ACTIVE is not None and FUNCTORCH_ACTIVE():
                from .ops import replay_at_step_op, replay_op

                if call == "replay_at_step":
                    return replay_at_step_op(self, sampled, idx_mapping, step)
                return replay_op(self, sampled, idx_mapping, *(lengths or ()))
            if self._closed:
                raise RuntimeError(_CLOSED) from None
            error = _not_a_tensor(sampled=sampled, idx_mapping=idx_mapping)
            if error is not None:
                raise error from None
            raise exc
        except BaseException:
            if self._warning_unsettled:  # this call took the one warning: the next replay gets it
                self._warned = self._warning_unsettled = False
            raise
