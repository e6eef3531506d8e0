"""The PyTorch decode driver every model runs on; on CUDA each decode step is one CUDA graph.

Two entry points, one path (:func:`.torch_steps.run_model`):

- :func:`decode_model` runs requests through a built model that keeps the
  :class:`TorchDecodeModel` protocol: a user's own model (no checkpoint, no registration, any
  cache layout) or a registry family's (:meth:`TorchFamily.model`).
- :func:`decoder` binds the driver to a registry family's :class:`TorchFamily` (its config
  class and weight check, the shape of its KV cache for the memory estimate, and ``build``,
  a :class:`TorchModel`) and returns the family's ``run_decode`` (the contract of
  :mod:`trace_replay_app.models.family`): the checks and memory estimate, then the model
  built, then the same steps. ``tensor_parallel=`` (:mod:`.torch_parallel`) is family-only.

The driver owns, once for every model:

- the argument checks and the schedule (:mod:`trace_replay_app.schedule`), and the memory
  estimate against ``torch.cuda.mem_get_info`` (:mod:`.memory`:
  :class:`~trace_replay_app.records.DeviceMemoryError` when it cannot fit);
- admission into slots, prefill of the admitted prompts in groups of at most
  ``prefill_tokens`` padded tokens, the per-slot lengths the replay state binds;
- the decode step on fixed buffers: the model's logits, sampling (greedy, or Gumbel-max with
  noise from a ``torch.Generator`` seeded with ``seed``), replay in place with
  :class:`trace_replay_torch.TraceReplayState`, logprob/rank/argmax in one pass over the
  unmodified logits (:func:`trace_replay_torch.token_logprob_rank`), the outputs recorded on
  the device and copied to the host once at the end;
- on CUDA, the step captured once in a CUDA graph and replayed; prefill, admission and
  ``apply_staged_writes`` run eagerly between replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from trace_replay_core import parse_device

from ..records import RequestResult, TraceRequest
from ..schedule import DecodeCall, check_decode, check_model_call, check_run, check_sampling, collect_results
from .memory import check_fits, estimate_bytes
from .torch_parallel import Merge, Shard, TensorParallel, shard_for
from .torch_steps import run_model, upload

__all__ = [
    "TorchDecodeModel",
    "TorchModel",
    "TorchFamily",
    "decode_model",
    "decoder",
    "free_bytes",
    "torch_device",
    "upload",
]


class TorchDecodeModel(Protocol):
    """What :func:`decode_model` needs of a model: its forward passes on one device over a KV
    cache of its own layout, batch rows serving slots.

    ``vocab_size``: token ids are below it, and ``decode`` returns that many logits per row.
    ``n_positions``: the most prompt + decoded tokens one request may hold (the driver asks
    for no longer cache).

    ``new_cache(slots, kv_len)``: the model's cache for ``slots`` slots of ``kv_len``
    positions each, allocated on the model's device (zeros, or anything: every position is
    written before a query reads it). Any object: a tensor, a tuple or dict of tensors, or
    ``None`` for a model that keeps its cache on itself. The cache is the model's: the driver
    holds the reference for the run and passes it back to ``prefill`` and ``decode``, and
    never reads, copies or replaces it. Called once per run, before any prefill.

    ``prefill(cache, slots, tokens)``: store the keys and values of ``tokens`` (int64
    ``[requests, n]``, positions ``0 .. n-1``, right-padded with zeros: a padding position may
    hold garbage that a decode step overwrites before any query reads it) in the caches of
    ``slots`` (int64 ``[requests]``). Returns nothing; called eagerly, between steps.

    ``decode(cache, tokens, positions)``: one token per row, row ``b`` feeding ``tokens[b]``
    (int64 ``[rows]``) at ``positions[b]`` (int64 ``[rows]``) to slot ``b``'s cache, keys and
    values written in place, attending to positions ``<= positions[b]``; returns the logits
    ``[rows, vocab_size]`` (float32, bfloat16 or float16) on the model's device. A row that
    decodes nothing gets position 0 and any token: it may write there, and that slot's next
    prefill or decode overwrites it. On CUDA the driver captures ``decode`` in a CUDA graph
    (``cuda_graph=False`` runs it eagerly): it must then be capturable, with fixed shapes, no
    host sync (``.item()``, ``.tolist()``, ``print`` of a tensor, a branch on a value), no
    cache rebound to new tensors, and only torch's current stream.

    Every call is stream-ordered on torch's current stream and runs under ``torch.no_grad()``.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def n_positions(self) -> int: ...

    def new_cache(self, slots: int, kv_len: int) -> Any: ...

    def prefill(self, cache: Any, slots: torch.Tensor, tokens: torch.Tensor) -> None: ...

    def decode(self, cache: Any, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class TorchModel(TorchDecodeModel, Protocol):
    """A registry family's model: :class:`TorchDecodeModel` (its cache a tensor of its
    family's ``cache_shape``, in the compute dtype) plus what the family's other drivers use.

    ``config``: the config of what this model holds (under tensor parallelism, this rank's
    share of the heads; its ``vocab_size`` is the whole vocabulary's, and ``decode`` returns
    this rank's vocabulary block). For ``score`` (:mod:`.torch_score`): ``hidden(tokens)``,
    the final-norm hidden states ``[requests, n, hidden]`` of right-padded ``tokens``
    ``[requests, n]`` (causal, no cache), and ``logits(hidden)``, the output projection of
    ``[rows, hidden]``. All are stream-ordered on the current stream."""

    config: Any

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def _never(config: Any, world: int) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class TorchFamily:
    """What a family gives the torch driver. ``config_type``, ``check_weights``: its config
    class and weight check. ``cache_shape(config, slots, kv_len)``: its KV cache's shape (the
    memory estimate counts it before anything is built). ``build(config, weights, device,
    dtype, shard)``: its :class:`TorchModel` (``shard``: a :class:`~.torch_parallel.Shard`
    under tensor parallelism, else ``None``; weights are the caller's numpy arrays, copied,
    never changed). ``splits_layers(config, world)``: whether its layers split over ``world``
    ranks (default: never). ``prefill_tokens``: padded prompt tokens per prefill call."""

    config_type: type
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None]
    cache_shape: Callable[[Any, int, int], tuple[int, ...]]
    build: Callable[[Any, Mapping[str, np.ndarray], torch.device, torch.dtype, Shard | None], TorchModel]
    splits_layers: Callable[[Any, int], bool] = _never
    prefill_tokens: int = 16384

    def model(
        self, config: Any, weights: Mapping[str, np.ndarray], *, device: str = "cpu", dtype: str = "float32"
    ) -> TorchModel:
        """The family's model of ``config``/``weights`` (numpy arrays, copied; the caller's
        are not changed) on ``device`` in the compute ``dtype`` (``"float32"`` or
        ``"bfloat16"``): a :class:`TorchDecodeModel` for :func:`decode_model`, e.g. one side of
        a parity test. ``decode_model(model, requests, prefill_tokens=family.prefill_tokens)``
        gives the bits of the family's ``run_decode`` with the same arguments. Arguments are
        checked first (``TypeError``/``ValueError`` naming them)."""
        check_run(config, weights, [], 1, None, config_type=self.config_type, check_weights=self.check_weights)
        check_sampling(dtype, 0.0, 0)
        return self.build(config, weights, torch_device(device), getattr(torch, dtype), None)


def torch_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (CUDA device 0) or ``"cuda:N"`` -> a torch.device usable here
    (``ValueError`` naming the device when torch sees no such GPU). Host-only."""
    dev = torch.device(parse_device(device))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: torch sees no CUDA GPU; use device='cpu'")
        if dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} is not available: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def free_bytes(device: torch.device) -> int | None:
    """Free bytes on ``device`` (``torch.cuda.mem_get_info``); ``None`` for the CPU (not checked)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def decode_model(
    model: TorchDecodeModel,
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    cuda_graph: bool | None = None,
    prefill_tokens: int = 16384,
) -> list[RequestResult]:
    """Decode ``requests`` through a built ``model`` (:class:`TorchDecodeModel`, living on
    ``device``), replaying their traces: the driver of every family's ``run_decode``, on a
    model of the caller's.

    ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, where the model lives; the driver's
    buffers go there. ``max_batch``, ``on_step``, ``temperature``, ``seed``, ``cuda_graph``
    and the results as in a family's ``run_decode`` (see :func:`_run`): one
    :class:`~trace_replay_app.records.RequestResult` per request, in request order; logprobs
    in float32 of the raw logits whatever their dtype. ``prefill_tokens``: the most padded
    prompt tokens per ``prefill`` call (1: one prompt per call, unpadded). The model computes
    in its own dtype; the caller's model and its weights are not changed, its cache is
    written. Requests are checked against ``model.vocab_size`` and ``model.n_positions``
    before anything runs (``TypeError``/``ValueError`` naming the argument); the driver's own
    buffers are checked against the free memory after the model's cache is allocated
    (:class:`~trace_replay_app.records.DeviceMemoryError`). Nothing waits for the device
    between steps; the outputs are copied to the host once at the end."""
    for name in ("new_cache", "prefill", "decode"):
        if not callable(getattr(model, name, None)):
            raise TypeError(f"model must have a callable {name}() (a TorchDecodeModel; got a {type(model).__name__})")
    call = check_model_call(
        model, requests, max_batch=max_batch, on_step=on_step, temperature=temperature, seed=seed, device=device
    )
    if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be an int >= 1 (got {prefill_tokens!r})")
    dev, use_graph = _device_and_graph(device, cuda_graph)
    outputs = None
    if call.schedule.n_steps:
        with torch.no_grad(), _on(dev):
            cache = model.new_cache(call.schedule.slots, call.kv_positions)
            check_fits(device, _estimate(call, model.vocab_size, itemsize=0, weights={}, cache=0), free_bytes(dev))
            outputs = run_model(model, cache, call, dev, use_graph=use_graph, prefill_tokens=prefill_tokens)
    return collect_results(requests, call.schedule, outputs)


def decoder(family: TorchFamily) -> Callable[..., list[RequestResult]]:
    """The ``run_decode`` of ``family`` on this driver (see :func:`_run` for the contract)."""

    def run_decode(
        config: Any,
        weights: Mapping[str, np.ndarray],
        requests: Sequence[TraceRequest],
        *,
        device: str = "cpu",
        max_batch: int = 8,
        on_step: Callable[[int], None] | None = None,
        dtype: str = "float32",
        temperature: float = 0.0,
        seed: int = 0,
        cuda_graph: bool | None = None,
        tensor_parallel: TensorParallel | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> list[RequestResult]:
        return _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed,
                    cuda_graph, tensor_parallel, logprobs_mode)  # fmt: skip

    run_decode.__doc__ = _run.__doc__
    return run_decode


def _device_and_graph(device: str, cuda_graph: Any) -> tuple[torch.device, bool]:
    """``device`` as a torch.device and whether the step is captured (``cuda_graph``: None,
    the default, captures on CUDA devices)."""
    if cuda_graph not in (None, True, False):
        raise TypeError(f"cuda_graph must be None, True or False (got {cuda_graph!r})")
    dev = torch_device(device)
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device (got device={device!r})")
    return dev, dev.type == "cuda" if cuda_graph is None else bool(cuda_graph)


def _on(dev: torch.device):
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _estimate(call: DecodeCall, vocab_size: int, *, itemsize: int, weights: Mapping[str, np.ndarray], cache: int):
    return estimate_bytes(
        weights=weights,
        itemsize=itemsize,
        cache_elements=cache,
        slots=call.schedule.slots,
        steps=call.schedule.n_steps,
        vocab_size=vocab_size,
        longest_trace=call.longest_trace,
        sampling=call.temperature > 0,
    )


def _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed, cuda_graph, tp,
         logprobs_mode):  # fmt: skip
    """Decode ``requests`` with the model ``config``/``weights``, replaying their traces.

    ``weights``: float numpy arrays under the family's names (copied to ``device`` in
    ``dtype``, ``"float32"`` or ``"bfloat16"``, the compute dtype; the caller's arrays are not
    changed). ``requests``: each decodes ``request.new_tokens`` tokens; a traced one is forced
    onto its trace at every step. ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    ``max_batch``: the most slots (and batch rows) decoding at once; the run uses
    ``min(max_batch, requests that decode)`` (:func:`trace_replay_app.schedule.plan`), and its
    buffers follow the requests' real lengths. ``temperature``: 0 decodes greedily (ties:
    lowest id); above 0, untraced rows sample from ``softmax(logits / temperature)`` (Gumbel-max,
    uniform noise from a ``torch.Generator`` seeded with ``seed`` on ``device``: the same
    arguments give the same tokens). ``on_step(k)`` is called on the host after each step is
    queued, with the tokens it decodes. ``cuda_graph``: capture the decode step in a CUDA
    graph (default: on CUDA devices; the eager step gives the same results).
    ``tensor_parallel``: a :class:`~.torch_parallel.TensorParallel` to run this rank's share
    of a ``torch.distributed`` job (call on every rank with the same arguments but ``device``;
    every rank returns the same results). ``logprobs_mode``: ``"raw_logprobs"`` (default: the
    logits as they are) or ``"processed_logprobs"`` (vLLM's: after temperature, when sampling;
    not with ``tensor_parallel``).

    Returns one :class:`~trace_replay_app.records.RequestResult` per request, in request
    order: tokens, ``forced``, the logprob and rank of each token under the unmodified logits
    (logprobs in float32, of the logits ``logprobs_mode`` names) and the greedy ``argmax``. Matrix products follow
    torch's float32 settings (full float32 unless the caller allowed TF32). Nothing waits for
    the device between steps; outputs are copied to the host once at the end. Arguments are
    checked before anything runs (``TypeError`` / ``ValueError`` naming the argument); a run
    that would not fit in the GPU's free memory raises
    :class:`~trace_replay_app.records.DeviceMemoryError` before anything is allocated there.
    """
    call = check_decode(
        config,
        weights,
        requests,
        max_batch=max_batch,
        on_step=on_step,
        dtype=dtype,
        temperature=temperature,
        seed=seed,
        config_type=family.config_type,
        check_weights=family.check_weights,
        device=device,
        logprobs_mode=logprobs_mode,
    )
    if tp is not None and call.logprob_temperature is not None:
        raise ValueError("logprobs_mode='processed_logprobs' with sampling is not supported with tensor_parallel")
    dev, use_graph = _device_and_graph(device, cuda_graph)
    shard = None if tp is None else shard_for(tp, config, family.splits_layers)
    outputs = None
    if call.schedule.n_steps:
        torch_dtype = getattr(torch, call.dtype)
        cache = int(np.prod(family.cache_shape(config, call.schedule.slots, call.kv_positions)))
        needed = _estimate(call, config.vocab_size, itemsize=torch_dtype.itemsize, weights=weights, cache=cache)
        check_fits(device, needed, free_bytes(dev))
        with torch.no_grad(), _on(dev):
            outputs = _decode_all(family, config, weights, call, dev, torch_dtype, use_graph, shard, tp)
    return collect_results(requests, call.schedule, outputs)


def _decode_all(family: TorchFamily, config, weights, call: DecodeCall, dev, dtype, use_graph, shard, tp):
    """The family's model built, then every step of ``call.schedule`` on it
    (:func:`.torch_steps.run_model`); the per-step outputs ``[n_steps, slots]`` on the host."""
    model = family.build(config, weights, dev, dtype, shard)
    cache = model.new_cache(call.schedule.slots, call.kv_positions)
    merge = None if shard is None else Merge(call.schedule.slots, config.vocab_size, shard, tp.group, dev)
    return run_model(model, cache, call, dev, use_graph=use_graph, prefill_tokens=family.prefill_tokens, merge=merge)
