"""The PyTorch decode driver every model family runs on; on CUDA each decode step is one CUDA graph.

A family supplies a :class:`TorchFamily`: its config class and weight check, the shape of its
KV cache, and ``build(config, weights, device, dtype, shard)``, a :class:`TorchModel` with its
prefill and decode math. :func:`decoder` binds the driver to it and returns the family's
``run_decode`` (the contract of :mod:`trace_replay_app.models.family`). The driver owns the
rest, once for every family:

- the argument checks and the schedule (:func:`trace_replay_app.schedule.check_decode`), and the
  memory estimate against ``torch.cuda.mem_get_info`` before anything is allocated on a GPU
  (:mod:`.memory`: :class:`~trace_replay_app.records.DeviceMemoryError` when it cannot fit);
- admission into slots, prefill of the admitted prompts in groups of at most
  ``TorchFamily.prefill_tokens`` padded tokens, the per-slot lengths the replay state binds;
- the decode step on fixed buffers: the family's logits, sampling (greedy, or Gumbel-max with
  noise from a ``torch.Generator`` seeded with ``seed``), replay in place with
  :class:`trace_replay_torch.TraceReplayState`, logprob/rank/argmax in one pass over the
  unmodified logits (:func:`trace_replay_torch.token_logprob_rank`), the outputs recorded on
  the device and copied to the host once at the end;
- on CUDA, the step captured once in a CUDA graph and replayed; prefill, admission and
  ``apply_staged_writes`` run eagerly between replays;
- tensor parallelism over a ``torch.distributed`` job as an option, ``tensor_parallel=``
  (:mod:`.torch_parallel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from trace_replay_core import parse_device
from trace_replay_torch import TraceReplayState, token_logprob_rank

from ..records import RequestResult, TraceRequest
from ..schedule import DecodeCall, check_decode, collect_results
from .memory import check_fits, estimate_bytes
from .torch_parallel import Merge, Shard, TensorParallel, shard_for

__all__ = ["TorchModel", "TorchFamily", "decoder", "free_bytes", "torch_device", "upload"]


class TorchModel(Protocol):
    """A family's forward passes on one device in one compute dtype, over a slot-indexed KV cache.

    ``config``: the config of what this model holds (under tensor parallelism, this rank's
    share of the heads). ``prefill(cache, slots, tokens)``: store the keys and values of
    ``tokens`` ``[requests, n]`` (int64, positions ``0 .. n-1``, right-padded: padding
    positions may hold garbage that a decode step overwrites before any query reads it) in the
    caches of ``slots`` ``[requests]``. ``decode(cache, tokens, positions)``: one token per
    row, row ``b`` feeding ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache; returns
    the logits ``[rows, vocab]`` (under tensor parallelism this rank's vocabulary block),
    float32 or the compute dtype; fixed shapes and no host sync (it is captured in a CUDA
    graph). For ``score`` (:mod:`.torch_score`): ``hidden(tokens)``, the final-norm hidden
    states ``[requests, n, hidden]`` of right-padded ``tokens`` ``[requests, n]`` (causal, no
    cache), and ``logits(hidden)``, the output projection of ``[rows, hidden]``. All are
    stream-ordered on the current stream."""

    config: Any

    def prefill(self, cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None: ...

    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def _never(config: Any, world: int) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class TorchFamily:
    """What a family gives the torch driver. ``config_type``, ``check_weights``: its config
    class and weight check. ``cache_shape(config, slots, kv_len)``: its KV cache's shape.
    ``build(config, weights, device, dtype, shard)``: its :class:`TorchModel` (``shard``: a
    :class:`~.torch_parallel.Shard` under tensor parallelism, else ``None``; weights are the
    caller's numpy arrays, copied, never changed). ``splits_layers(config, world)``: whether
    its layers split over ``world`` ranks (default: never). ``prefill_tokens``: padded prompt
    tokens per prefill call."""

    config_type: type
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None]
    cache_shape: Callable[[Any, int, int], tuple[int, ...]]
    build: Callable[[Any, Mapping[str, np.ndarray], torch.device, torch.dtype, Shard | None], TorchModel]
    splits_layers: Callable[[Any, int], bool] = _never
    prefill_tokens: int = 16384


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


def upload(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a new tensor on ``device``; on CUDA through pinned memory, queued on the
    current stream without waiting for the device (a pageable copy would wait for every step
    queued before it)."""
    host = torch.as_tensor(np.asarray(values)).to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
    ) -> list[RequestResult]:
        return _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed,
                    cuda_graph, tensor_parallel)  # fmt: skip

    run_decode.__doc__ = _run.__doc__
    return run_decode


def _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed, cuda_graph, tp):
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
    every rank returns the same results).

    Returns one :class:`~trace_replay_app.records.RequestResult` per request, in request
    order: tokens, ``forced``, the logprob and rank of each token under the unmodified logits
    (logprobs in float32, before temperature) and the greedy ``argmax``. Matrix products follow
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
    )
    if cuda_graph not in (None, True, False):
        raise TypeError(f"cuda_graph must be None, True or False (got {cuda_graph!r})")
    shard = None if tp is None else shard_for(tp, config, family.splits_layers)
    dev = torch_device(device)
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device (got device={device!r})")
    outputs = None
    if call.schedule.n_steps:
        torch_dtype = getattr(torch, call.dtype)
        needed = estimate_bytes(
            weights=weights,
            itemsize=torch_dtype.itemsize,
            cache_elements=int(np.prod(family.cache_shape(config, call.schedule.slots, call.kv_positions))),
            slots=call.schedule.slots,
            steps=call.schedule.n_steps,
            vocab_size=config.vocab_size,
            longest_trace=call.longest_trace,
            sampling=call.temperature > 0,
        )
        check_fits(device, needed, free_bytes(dev))
        use_graph = dev.type == "cuda" if cuda_graph is None else cuda_graph
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), on_device:
            outputs = _decode_all(family, config, weights, call, dev, torch_dtype, use_graph, shard, tp)
    return collect_results(requests, call.schedule, outputs)


class _Buffers:
    """The fixed device buffers of one run, made once and never reallocated (a CUDA graph
    replays their addresses): per-slot ``prompt_len``/``total_len`` (bound to the replay
    state), the token each row feeds next, the step's ``idx_mapping`` and ``sampled`` tokens,
    the step counter, the per-step outputs ``[n_steps, slots]`` and, when sampling, the uniform
    noise ``[slots, vocab_size]`` of a ``torch.Generator`` seeded with ``seed``."""

    def __init__(self, call: DecodeCall, vocab_size: int, dev: torch.device):
        rows, steps = call.schedule.slots, call.schedule.n_steps
        self.prompt_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # per slot, read by replay
        self.total_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # prompt + tokens decoded so far
        self.last = torch.zeros(rows, dtype=torch.int64, device=dev)  # the token each row feeds next
        self.idx_all = torch.from_numpy(call.schedule.idx_mapping).to(dev)
        self.idx_mapping = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.sampled = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.step_t = torch.zeros(1, dtype=torch.int64, device=dev)  # the step the graph writes
        kinds = (("tokens", torch.int64), ("argmax", torch.int64), ("logprobs", torch.float32), ("ranks", torch.int64))
        self.out = {name: torch.zeros(steps, rows, dtype=dt, device=dev) for name, dt in kinds}
        sampling = call.temperature > 0
        self.generator = torch.Generator(device=dev).manual_seed(call.seed) if sampling else None
        self.uniform = torch.full((rows, vocab_size), 0.5, dtype=torch.float32, device=dev) if sampling else None

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(active, positions)`` of the step: rows in use, and each one's cache position
        (empty rows: 0, anywhere in range)."""
        active = self.idx_mapping >= 0
        return active, torch.where(active, self.total_len.long() - 1, 0)

    def gumbel(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The step's Gumbel noise over the vocabulary ids ``[start, end)``."""
        assert self.uniform is not None
        u = self.uniform[:, start:end]
        return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))

    def record(self, active: torch.Tensor, argmax: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor) -> None:
        """The step's tail: its outputs into row ``step_t``, active rows one token longer and
        fed their ``sampled`` token next, the counter advanced (all on the device)."""
        for name, value in (("tokens", self.sampled), ("argmax", argmax), ("logprobs", logprobs), ("ranks", ranks)):
            self.out[name].index_copy_(0, self.step_t, value[None])
        self.total_len.add_(active.to(torch.int32))
        self.last.copy_(torch.where(active, self.sampled, self.last))
        self.step_t.add_(1)


class _Score:
    """Sampling, replay and logprob/rank/argmax of one device's whole-vocabulary logits."""

    def __init__(self, rows: int, dev: torch.device, temperature: float):
        self.temperature = temperature
        self.logprobs = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.ranks = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.argmax = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=dev)  # rows that take their argmax

    def __call__(self, logits: torch.Tensor, buf: _Buffers, state: TraceReplayState):
        """Greedy: every row -1 ("take the argmax") until the logprob pass, which scores the
        -1 rows as their argmax; replay writes the traced rows in between."""
        if buf.uniform is None:
            buf.sampled.fill_(-1)
        else:
            buf.sampled.copy_((logits.float() / self.temperature + buf.gumbel()).argmax(dim=-1))
        state.replay(buf.sampled, buf.idx_mapping)  # traced rows take their trace token
        # From the unmodified logits; argmax ties: the lowest id, as torch.argmax.
        token_logprob_rank(logits, buf.sampled, argmax=True, out=(self.logprobs, self.ranks, self.argmax))
        if buf.uniform is None:
            torch.lt(buf.sampled, 0, out=self.greedy)
            torch.where(self.greedy, self.argmax, buf.sampled, out=buf.sampled)
        return self.argmax, self.logprobs, self.ranks


class _ShardScore:
    """The same on this rank's vocabulary block, merged over the ranks (:class:`~.torch_parallel.Merge`)."""

    def __init__(self, merge: Merge, temperature: float):
        self.merge, self.temperature = merge, temperature

    def __call__(self, logits: torch.Tensor, buf: _Buffers, state: TraceReplayState):
        x = logits.float()
        perturbed = None
        if buf.uniform is not None:  # the one-device loop's noise; this rank reads its block
            perturbed = x / self.temperature + buf.gumbel(self.merge.start, self.merge.end)
        argmax, m, drawn = self.merge.argmax(x, perturbed)
        buf.sampled.copy_(drawn)
        state.replay(buf.sampled, buf.idx_mapping)  # local, the same on every rank
        logprobs, ranks = self.merge.logprob_rank(x, m, buf.sampled)
        return argmax, logprobs, ranks


def _decode_all(family: TorchFamily, config, weights, call: DecodeCall, dev, dtype, use_graph, shard, tp):
    """Every step of ``call.schedule``; the per-step outputs ``[n_steps, slots]`` on the host."""
    model = family.build(config, weights, dev, dtype, shard)
    rows = call.schedule.slots
    cache = torch.zeros(family.cache_shape(model.config, rows, call.kv_positions), dtype=dtype, device=dev)
    buf = _Buffers(call, config.vocab_size, dev)
    if shard is None:
        score: Callable = _Score(rows, dev, call.temperature)
    else:
        score = _ShardScore(Merge(rows, config.vocab_size, shard, tp.group, dev), call.temperature)

    def step(state: TraceReplayState) -> None:
        """One decode step of every row on fixed buffers (no host sync, no allocation the
        graph cannot own); the logits are read once after the model."""
        active, positions = buf.positions()
        argmax, logprobs, ranks = score(model.decode(cache, buf.last, positions), buf, state)
        buf.record(active, argmax, logprobs, ranks)

    return _run_steps(model, cache, buf, call, family.prefill_tokens, config.vocab_size, dev, step, use_graph)


def prefill_groups(admitted: list[int], prompts: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Requests (indices) that prefill together: consecutive, at most ``budget`` padded tokens
    per group; prompts of one token have nothing to prefill."""
    groups: list[list[int]] = []
    group: list[int] = []
    longest = 0
    for i in admitted:
        n = len(prompts[i]) - 1
        if n <= 0:
            continue
        if group and max(longest, n) * (len(group) + 1) > budget:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    return groups + ([group] if group else [])


def _run_steps(model, cache, buf: _Buffers, call: DecodeCall, budget: int, vocab_size: int, dev, step, use_graph):
    """Every step: prefill and admit the step's requests (lengths, last tokens, traces),
    ``apply_staged_writes``, then ``step(state)`` on ``buf`` (captured once in a CUDA graph
    when ``use_graph``). Returns the outputs on the host, copied once at the end."""
    schedule, prompts, traces = call.schedule, call.prompts, call.traces
    per_step = schedule.tokens_per_step.tolist()
    with TraceReplayState(
        schedule.slots,
        call.longest_trace,
        device=dev,
        total_len=buf.total_len,
        prompt_len=buf.prompt_len,
        vocab_size=vocab_size,
    ) as state:
        graph = _capture(lambda: step(state), buf.step_t) if use_graph else None
        for k in range(schedule.n_steps):
            admitted = schedule.admitted(k).tolist()
            for group in prefill_groups(admitted, prompts, budget):
                n = max(len(prompts[i]) - 1 for i in group)
                block = np.zeros((len(group), n), dtype=np.int64)
                for j, i in enumerate(group):
                    block[j, : len(prompts[i]) - 1] = prompts[i][:-1]
                slots = upload([schedule.slot[i] for i in group], torch.int64, dev)
                model.prefill(cache, slots, upload(block, torch.int64, dev))
            if admitted:
                slots = upload([schedule.slot[i] for i in admitted], torch.int64, dev)
                lens = upload([len(prompts[i]) for i in admitted], torch.int32, dev)
                buf.prompt_len[slots] = lens
                buf.total_len[slots] = lens
                buf.last[slots] = upload([prompts[i][-1] for i in admitted], torch.int64, dev)
                for i in admitted:
                    state.add_request(int(schedule.slot[i]), traces[i])  # None: untraced
            state.apply_staged_writes()  # outside the graph, between replays
            buf.idx_mapping.copy_(buf.idx_all[k])
            if buf.uniform is not None:
                torch.rand(buf.uniform.shape, generator=buf.generator, device=dev, out=buf.uniform)
            if graph is None:
                step(state)
            else:
                graph.replay()
            if call.on_step is not None:
                call.on_step(per_step[k])
        return {name: t.cpu().numpy() for name, t in buf.out.items()}


def _capture(step: Callable[[], None], step_t: torch.Tensor) -> torch.cuda.CUDAGraph:
    """``step`` captured in a CUDA graph, after one eager warm-up on a side stream (which
    compiles the kernels and binds the replay). The caller's ``idx_mapping`` is all -1 then,
    so the warm-up decodes nothing: it writes only cache position 0 (before any prefill) and
    output row 0 (rewritten by the first real step); ``step_t`` is reset after it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    step_t.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
