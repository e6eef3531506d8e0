"""The continuous-batching schedule of the reference decode loops, and the checks of their arguments.

Both decode drivers (``trace_replay_app.drivers.torch_driver`` and ``.jax_driver``) run the
schedule made here, so the two frameworks decode identical batches step by step; :func:`check_decode`
is the one check of a ``run_decode`` call's arguments. Numpy only.

The rules: the loop has ``slots = min(max_batch, requests that decode)`` slots (at least one;
more would never be used) and a fixed row layout of that many batch rows, row ``b`` serving
slot ``b``. Requests are admitted in input order, each into the free slot
with the lowest index, at the first step where one is free: a request that decodes ``n``
tokens and is admitted before step ``s`` decodes at steps ``s .. s + n - 1`` and frees its slot
for the next waiting request at step ``s + n``. Requests with no new tokens take no slot.
Since every request's length is known up front, the whole schedule is known on the host
before the first step, and the loops never ask the device which rows are done.

Example::

    >>> s = plan([3, 1, 2, 1], max_batch=2)
    >>> s.slot.tolist(), s.start.tolist(), s.n_steps
    ([0, 1, 1, 0], [0, 0, 1, 3], 4)
    >>> s.idx_mapping.tolist()          # per step, row -> slot (-1: empty row)
    [[0, 1], [0, 1], [0, 1], [0, -1]]
    >>> plan([5, 2], max_batch=10**11).slots   # slots follow the work, not the option
    2
"""

from __future__ import annotations

import dataclasses
import heapq
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from trace_replay_core import split_device

from .records import RequestResult, TraceRequest

__all__ = [
    "Schedule",
    "DecodeCall",
    "plan",
    "slots_for",
    "check_decode",
    "check_model_call",
    "check_limits",
    "check_run",
    "check_device",
    "check_sampling",
    "request_arrays",
    "collect_results",
    "COMPUTE_DTYPES",
    "LOGPROBS_MODES",
    "check_logprobs_mode",
]

COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which request decodes in which slot at which step.

    ``slots``: slots and batch rows of the loop (``min(max_batch, requests that decode)``, at
    least 1). ``slot[i]``, ``start[i]``: slot and first decode step of request ``i`` (-1 for a
    request with no new tokens); ``new_tokens[i]``: how many steps it decodes. ``idx_mapping``:
    ``[n_steps, slots]`` int32, ``idx_mapping[k, b] = b`` when row ``b`` decodes at step
    ``k`` and -1 when it is empty.
    """

    slots: int
    slot: np.ndarray
    start: np.ndarray
    new_tokens: np.ndarray
    idx_mapping: np.ndarray

    @property
    def n_steps(self) -> int:
        return int(self.idx_mapping.shape[0])

    @property
    def tokens_per_step(self) -> np.ndarray:
        """``[n_steps]``: rows that decode a token at each step (all > 0)."""
        return (self.idx_mapping >= 0).sum(axis=1)

    def admitted(self, step: int) -> np.ndarray:
        """Indices of the requests that join just before ``step``, in input order."""
        return np.nonzero(self.start == step)[0]

    def kv_positions(self, prompt_lens: Sequence[int]) -> int:
        """The most KV-cache positions any scheduled request fills: its prompt plus its new
        tokens, less the last token (sampled, never fed back). ``prompt_lens[i]``: request
        ``i``'s prompt length. Needs at least one scheduled request."""
        return max(int(prompt_lens[int(i)]) + int(self.new_tokens[i]) - 1 for i in np.nonzero(self.slot >= 0)[0])

    def outputs(self, i: int, per_step: np.ndarray) -> np.ndarray:
        """Request ``i``'s entries of a ``[n_steps, slots, ...]`` per-step array, in decode order."""
        if self.slot[i] < 0:
            return per_step[:0, 0]
        return per_step[self.start[i] : self.start[i] + self.new_tokens[i], self.slot[i]]


def slots_for(new_tokens: Sequence[int], max_batch: int) -> int:
    """The slots of a run of requests decoding ``new_tokens``: ``min(max_batch, those > 0)``, at least 1."""
    return max(1, min(int(max_batch), sum(1 for n in new_tokens if n > 0)))


def plan(new_tokens: Sequence[int], max_batch: int) -> Schedule:
    """The schedule of requests decoding ``new_tokens[i]`` tokens each through at most
    ``max_batch`` slots (``max_batch`` may be far above the work: the schedule, and every buffer
    a loop sizes from it, has ``min(max_batch, requests that decode)`` rows).

    Host-only and deterministic; see the module docstring for the rules.
    """
    _check_slots_and_callback(max_batch, None)
    counts = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
    if (counts < 0).any():
        raise ValueError(f"new_tokens must be >= 0 (got {counts[counts < 0][0]})")
    slots = slots_for(counts.tolist(), max_batch)
    slot = np.full(counts.size, -1, dtype=np.int32)
    start = np.full(counts.size, -1, dtype=np.int32)
    free = [(0, s) for s in range(slots)]  # (step the slot is free from, slot): a heap
    for i, n in enumerate(counts):
        if n == 0:
            continue
        free_at, s = heapq.heappop(free)
        # Input order holds by construction: the earliest free step never decreases.
        slot[i], start[i] = s, free_at
        heapq.heappush(free, (free_at + int(n), s))
    n_steps = int((start + counts).max(initial=0))
    idx_mapping = np.full((n_steps, slots), -1, dtype=np.int32)
    for i in np.nonzero(counts > 0)[0].tolist():
        idx_mapping[start[i] : start[i] + counts[i], slot[i]] = slot[i]
    return Schedule(slots, slot, start, counts.astype(np.int32), idx_mapping)


def _ids(value: Any, what: str, vocab_size: int) -> np.ndarray:
    """``value`` as a 1-D int64 array of ids in ``[0, vocab_size)``, or a ValueError naming ``what``."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of token ids (got {type(value).__name__})")
    try:
        ids = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - ragged or odd input: report it as what it is
        raise ValueError(f"{what} must be a sequence of token ids ({exc})") from None
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D sequence of int token ids (got {ids.dtype}{list(ids.shape)})")
    bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}]={ids[bad[0]]} is outside [0, vocab_size={vocab_size})")
    return ids.astype(np.int64)


def request_arrays(config: Any, requests: Sequence[TraceRequest], *, limits: str = "config"):
    """Validated ``(prompts, traces)``: per request, the prompt as int64 ids and the trace as
    int64 ids or ``None``, checked against ``config.vocab_size`` and ``config.n_positions``
    (``limits``: what messages call ``config``). Raises ``TypeError``/``ValueError`` naming the
    request and the field."""
    if isinstance(requests, (str, bytes, TraceRequest)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of TraceRequest (got {type(requests).__name__})")
    prompts, traces = [], []
    for i, r in enumerate(requests):
        if not isinstance(r, TraceRequest):
            raise TypeError(f"requests[{i}] must be a TraceRequest (got {type(r).__name__})")
        who = f"requests[{i}] (id {r.id!r})"
        prompt = _ids(r.prompt, f"{who}: prompt", config.vocab_size)
        if prompt.size == 0:
            raise ValueError(f"{who}: prompt must hold at least one token (got an empty prompt)")
        trace = None
        if r.trace is not None:
            trace = _ids(r.trace, f"{who}: trace", config.vocab_size)
            if trace.size == 0:
                raise ValueError(
                    f"{who}: trace must hold at least one token (got an empty trace); "
                    f"use trace=None with max_new_tokens for free decoding"
                )
        elif (
            isinstance(r.max_new_tokens, bool)
            or not isinstance(r.max_new_tokens, numbers.Integral)
            or r.max_new_tokens < 0
        ):
            raise ValueError(f"{who}: max_new_tokens must be an int >= 0 (got {r.max_new_tokens!r})")
        total = prompt.size + r.new_tokens
        if total > config.n_positions:
            raise ValueError(
                f"{who}: prompt ({prompt.size} tokens) + {r.new_tokens} new tokens = {total} "
                f"exceeds {limits}.n_positions={config.n_positions}"
            )
        prompts.append(prompt)
        traces.append(trace)
    return prompts, traces


def _check_slots_and_callback(max_batch: Any, on_step: Any) -> None:
    """Refuse a ``max_batch`` that is not an int >= 1 and an ``on_step`` that is neither None
    nor callable, naming the argument."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, numbers.Integral) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1 (got {max_batch!r})")
    if on_step is not None and not callable(on_step):
        raise TypeError(
            f"on_step must be a callable taking the tokens decoded in a step, or None (got {type(on_step).__name__})"
        )


def check_device(device: Any) -> None:
    """Refuse a ``device`` that is not ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (whether it exists
    is for the framework to say)."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a str: 'cpu', 'cuda' or 'cuda:N' (got {type(device).__name__})")
    try:
        split_device(device)  # the core's one device parser
    except ValueError:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (got {device!r})") from None


def check_sampling(dtype: Any, temperature: Any, seed: Any) -> float:
    """Refuse a compute ``dtype`` other than ``"float32"``/``"bfloat16"``, a ``temperature``
    that is not a finite number >= 0, or a ``seed`` that is not an int in ``[0, 2**63)``;
    returns the temperature as a float. Host-only."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {dtype!r})")
    return _temperature_seed(temperature, seed)


def _temperature_seed(temperature: Any, seed: Any) -> float:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 <= float(temperature) < float("inf")
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy) (got {temperature!r})")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63) (got {seed!r})")
    return float(temperature)


def check_run(
    config: Any,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    max_batch: int,
    on_step: Any | None,
    *,
    config_type: type,
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None],
):
    """Every check of a ``run_decode``'s arguments but ``device`` (see :func:`check_device`) and
    the sampling ones (see :func:`check_sampling`): ``config`` an instance of ``config_type``,
    ``weights`` passing the family's ``check_weights`` and floating-point; returns the
    requests' validated ``(prompts, traces)`` (see :func:`request_arrays`).

    Raises ``TypeError``/``ValueError`` naming the argument and what was received; host-only.
    """
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__} (got {type(config).__name__})")
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of parameter name -> array (got {type(weights).__name__})")
    check_weights(config, weights)
    for name, value in weights.items():
        kind = np.asarray(value).dtype.kind
        if kind != "f":
            raise ValueError(f"weights[{name!r}] must be a floating-point array (got dtype {np.asarray(value).dtype})")
    _check_slots_and_callback(max_batch, on_step)
    return request_arrays(config, requests)


_OUTPUT_DTYPES = {"tokens": np.int64, "argmax": np.int64, "logprobs": np.float32, "ranks": np.int64}


def collect_results(
    requests: Sequence[TraceRequest], schedule: Schedule, outputs: Mapping[str, np.ndarray] | None
) -> list[RequestResult]:
    """One :class:`RequestResult` per request, in request order, cut out of a loop's per-step
    host outputs ``[n_steps, slots]`` (``tokens``, ``argmax``, ``logprobs``, ``ranks``;
    ``None`` when the schedule has no step). ``forced`` is True for every token of a traced
    request (it decodes exactly its trace)."""
    if outputs is None:
        outputs = {name: np.zeros((0, schedule.slots), dtype) for name, dtype in _OUTPUT_DTYPES.items()}
    results = []
    for i, r in enumerate(requests):
        cut = {name: schedule.outputs(i, outputs[name]).astype(dtype) for name, dtype in _OUTPUT_DTYPES.items()}
        results.append(RequestResult(id=r.id, forced=np.full(cut["tokens"].shape, r.trace is not None), **cut))
    return results


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A ``run_decode`` call whose arguments passed :func:`check_decode` (or a call on a built
    model that passed :func:`check_model_call`).

    ``prompts``/``traces``: per request, int64 ids (a trace or ``None``); ``schedule``: its
    :func:`plan`; ``temperature`` as a float; ``dtype``: the compute dtype's name (``None`` on
    a built model: it computes in its own); ``seed``; ``on_step``: the caller's callback or
    ``None``; ``logprobs_mode``: one of :data:`LOGPROBS_MODES`."""

    prompts: list
    traces: list
    schedule: Schedule
    dtype: str | None
    temperature: float
    seed: int
    on_step: Callable[[int], None] | None
    logprobs_mode: str = "raw_logprobs"

    @property
    def logprob_temperature(self) -> float | None:
        """The temperature the logprobs are taken at: ``temperature`` for
        ``"processed_logprobs"`` when sampling (vLLM's processed logprobs: after temperature;
        no top-k or top-p is applied here), else None (the raw logits)."""
        return self.temperature if self.logprobs_mode == "processed_logprobs" and self.temperature > 0 else None

    @property
    def kv_positions(self) -> int:
        """The most KV-cache positions a request fills (see :meth:`Schedule.kv_positions`); 0 with no step."""
        if not self.schedule.n_steps:
            return 0
        return self.schedule.kv_positions([len(p) for p in self.prompts])

    @property
    def longest_trace(self) -> int:
        """The longest trace's length (1 when no request is traced: a replay table needs a column)."""
        return max((len(t) for t in self.traces if t is not None), default=1)


def check_decode(
    config: Any,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    max_batch: int,
    on_step: Any,
    dtype: Any,
    temperature: Any,
    seed: Any,
    config_type: type,
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None],
    device: Any = None,
    logprobs_mode: Any = "raw_logprobs",
) -> DecodeCall:
    """Every framework-neutral check of a ``run_decode`` call (:func:`check_run`,
    :func:`check_sampling`, and :func:`check_device` unless ``device`` is None), then the
    schedule. The one place these checks live; host-only; a refused call raises
    ``TypeError``/``ValueError`` naming the argument before anything is allocated."""
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=config_type, check_weights=check_weights
    )
    temp = check_sampling(dtype, temperature, seed)
    if device is not None:
        check_device(device)
    mode = check_logprobs_mode(logprobs_mode)
    schedule = plan([r.new_tokens for r in requests], max_batch)
    return DecodeCall(prompts, traces, schedule, dtype, temp, int(seed), on_step, mode)


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def check_logprobs_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`LOGPROBS_MODES` (vLLM's names: the logprobs of the raw
    logits, or of the logits after temperature), else ``ValueError`` naming it."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)} (got {mode!r})")
    return mode


def check_limits(model: Any) -> None:
    """Refuse a ``model`` whose ``vocab_size`` or ``n_positions`` is not an int >= 1 (the two
    limits a decode driver checks requests against), naming the attribute. Host-only."""
    for name in ("vocab_size", "n_positions"):
        value = getattr(model, name, None)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise TypeError(f"model.{name} must be an int >= 1 (got {value!r} from a {type(model).__name__})")


def check_model_call(
    model: Any,
    requests: Sequence[TraceRequest],
    *,
    max_batch: Any,
    on_step: Any,
    temperature: Any,
    seed: Any,
    device: Any,
) -> DecodeCall:
    """The checks of a decode call on a built ``model`` (the drivers' ``decode_model``): its
    ``vocab_size`` and ``n_positions`` (:func:`check_limits`), ``max_batch``, ``on_step``, the
    requests against those limits (:func:`request_arrays`), ``temperature``, ``seed`` and
    ``device``; then the schedule. The returned call's ``dtype`` is ``None``: the model computes
    in its own. Host-only; ``TypeError``/``ValueError`` naming the argument."""
    check_limits(model)
    _check_slots_and_callback(max_batch, on_step)
    prompts, traces = request_arrays(model, requests, limits="model")
    temp = _temperature_seed(temperature, seed)
    check_device(device)
    schedule = plan([r.new_tokens for r in requests], int(max_batch))
    return DecodeCall(prompts, traces, schedule, None, temp, int(seed), on_step)
