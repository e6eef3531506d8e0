"""The decode steps of the PyTorch driver, on any model that keeps the decode protocol.

:func:`run_model` runs a checked call (:class:`~trace_replay_app.schedule.DecodeCall`) on a
built model and its cache: admission into slots, prefill in groups, the per-slot lengths the
replay state binds, and each decode step on fixed buffers (the model's logits, sampling,
replay in place, logprob/rank/argmax from the unmodified logits, the outputs recorded on the
device), captured once in a CUDA graph when asked. Both entry points of
:mod:`.torch_driver` end here: a registry family's ``run_decode`` and ``decode_model`` on a
user's model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trace_replay_torch import TraceReplayState, token_logprob_rank

from ..schedule import DecodeCall
from .torch_parallel import Merge

__all__ = ["Buffers", "Score", "ShardScore", "prefill_groups", "run_model", "upload"]


def upload(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a new tensor on ``device``; on CUDA through pinned memory, queued on the
    current stream without waiting for the device (a pageable copy would wait for every step
    queued before it)."""
    host = torch.as_tensor(np.asarray(values)).to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Buffers:
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


class Score:
    """Sampling, replay and logprob/rank/argmax of one device's whole-vocabulary logits."""

    def __init__(self, rows: int, dev: torch.device, temperature: float, logprob_temperature: float | None):
        self.temperature = temperature
        # processed logprobs: of logits / T (one value per row, made once: the step is a graph)
        self.logprob_t = None
        if logprob_temperature is not None:
            self.logprob_t = torch.full((rows,), logprob_temperature, dtype=torch.float32, device=dev)
        self.logprobs = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.ranks = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.argmax = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.greedy = torch.zeros(rows, dtype=torch.bool, device=dev)  # rows that take their argmax

    def __call__(self, logits: torch.Tensor, buf: Buffers, state: TraceReplayState):
        """Greedy: every row -1 ("take the argmax") until the logprob pass, which scores the
        -1 rows as their argmax; replay writes the traced rows in between."""
        if buf.uniform is None:
            buf.sampled.fill_(-1)
        else:
            buf.sampled.copy_((logits.float() / self.temperature + buf.gumbel()).argmax(dim=-1))
        state.replay(buf.sampled, buf.idx_mapping)  # traced rows take their trace token
        # From the unmodified logits; argmax ties: the lowest id, as torch.argmax.
        token_logprob_rank(logits, buf.sampled, argmax=True, temperature=self.logprob_t,
                           out=(self.logprobs, self.ranks, self.argmax))  # fmt: skip
        if buf.uniform is None:
            torch.lt(buf.sampled, 0, out=self.greedy)
            torch.where(self.greedy, self.argmax, buf.sampled, out=buf.sampled)
        return self.argmax, self.logprobs, self.ranks


class ShardScore:
    """The same on this rank's vocabulary block, merged over the ranks (:class:`~.torch_parallel.Merge`)."""

    def __init__(self, merge: Merge, temperature: float):
        self.merge, self.temperature = merge, temperature

    def __call__(self, logits: torch.Tensor, buf: Buffers, state: TraceReplayState):
        x = logits.float()
        perturbed = None
        if buf.uniform is not None:  # the one-device loop's noise; this rank reads its block
            perturbed = x / self.temperature + buf.gumbel(self.merge.start, self.merge.end)
        argmax, m, drawn = self.merge.argmax(x, perturbed)
        buf.sampled.copy_(drawn)
        state.replay(buf.sampled, buf.idx_mapping)  # local, the same on every rank
        logprobs, ranks = self.merge.logprob_rank(x, m, buf.sampled)
        return argmax, logprobs, ranks


def run_model(model: Any, cache: Any, call: DecodeCall, dev: torch.device, *, use_graph: bool, prefill_tokens: int,
              merge: Merge | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """Every step of ``call.schedule`` on ``model`` (a :class:`~.torch_driver.TorchDecodeModel`,
    its ``vocab_size`` the width of the vocabulary) and its ``cache`` (from its ``new_cache``,
    passed back to its ``prefill`` and ``decode``, never read here); the per-step outputs
    ``[n_steps, slots]`` on the host (one copy at the end: host-blocking there, not per step).

    ``use_graph``: capture the decode step once in a CUDA graph and replay it (CUDA only).
    ``prefill_tokens``: the most padded prompt tokens per ``prefill`` call. ``merge``: under
    tensor parallelism, the logits are this rank's vocabulary block, merged over the ranks.
    Call under ``torch.no_grad()`` on ``dev``'s device."""
    rows = call.schedule.slots
    buf = Buffers(call, model.vocab_size, dev)
    if merge is None:
        score: Callable = Score(rows, dev, call.temperature, call.logprob_temperature)
    else:
        score = ShardScore(merge, call.temperature)

    def step(state: TraceReplayState) -> None:
        """One decode step of every row on fixed buffers (no host sync, no allocation the
        graph cannot own); the logits are read once after the model."""
        active, positions = buf.positions()
        argmax, logprobs, ranks = score(model.decode(cache, buf.last, positions), buf, state)
        buf.record(active, argmax, logprobs, ranks)

    return _run_steps(model, cache, buf, call, prefill_tokens, model.vocab_size, dev, step, use_graph)


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


def _run_steps(model, cache, buf: Buffers, call: DecodeCall, budget: int, vocab_size: int, dev, step, use_graph):
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
