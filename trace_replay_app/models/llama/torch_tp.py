"""The Llama-family torch decode loop, tensor-parallel over the ranks of a ``torch.distributed`` job.

:func:`run_decode_tp` is :func:`.torch_loop.run_decode` split over ``world_size`` ranks, one
device each (``gloo`` on CPUs, ``nccl`` on GPUs):

- Vocabulary-parallel output projection: rank ``r`` holds rows ``[start_r, end_r)`` of the
  output projection (``lm_head``, or the tied embedding) and computes that block of every
  row's logits. The blocks are as even as ``vocab_size`` allows (they need not be equal).
- Tensor-parallel attention and MLP when the sizes split evenly (``num_key_value_heads`` and
  ``intermediate_size`` multiples of ``world_size``): rank ``r`` holds its share of the
  key/value heads with their query heads (q/k/v column-parallel, ``o_proj`` row-parallel) and
  its share of the MLP's hidden units (gate/up column-parallel, ``down_proj`` row-parallel);
  the two row-parallel products of each layer are summed with one ``all_reduce`` each, their
  biases added after it. Otherwise every rank runs the whole layer stack (``tp_layers=False``
  forces that). The embedding is replicated.
- The merge of the vocabulary blocks, per row, in a fixed order: rank ``r`` contributes its
  block's maximum and argmax (and, when sampling, the maximum of ``logits / T + gumbel`` and
  where it is); all are gathered (``all_gather``) and merged in rank order 0, 1, ... (strict
  ``>``: ties go to the lower rank, so to the lowest id). Every rank then holds the same
  ``sampled`` and replays it with its own :class:`trace_replay_torch.TraceReplayState` on its
  own device: replay is local and identical on every rank. Logprob and rank of the token from
  the unmodified logits: a second gather brings each block's candidate for the chosen logit
  (taken from the rank that owns the token) and its sum of ``exp(x - M)`` (``M`` the merged
  maximum), a third each block's count of ``x >= chosen``; sums and counts are added in rank
  order. So the bits depend on the logits and the number of ranks only, never on how a
  collective combines values. Logprob = ``chosen - (M + log(sum))`` in float32; rank = the
  1-based count of ``>=`` (vLLM's definition, as :func:`trace_replay_torch.token_logprob_rank`).
  Logits are taken to be finite (no NaN handling across blocks).

Cost per decode step on top of the model: two ``all_reduce`` of ``[rows, hidden]`` per layer
(tensor-parallel layers), three ``all_gather`` of a few values per row. On CUDA the step,
collectives included, is captured once in a CUDA graph (NCCL collectives are capturable) and
replayed; ``cuda_graph=False`` runs it eagerly.

Example (two processes, each after ``torch.distributed.init_process_group("gloo", ...)``)::

    results = run_decode_tp(config, weights, requests, device="cpu")
    # the same results on every rank; tokens equal to torch_loop.run_decode's

Launch on two GPUs with ``torchrun --nproc_per_node=2`` (``device=f"cuda:{rank}"``, ``nccl``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trace_replay_torch import TraceReplayState

from ...records import RequestResult, TraceRequest
from ...schedule import check_run, check_sampling, collect_results, plan
from .config import LlamaConfig, check_weights
from .torch_loop import _Buffers, _Llama, _run_steps, _torch_device

__all__ = ["run_decode_tp", "vocab_blocks", "splits_layers"]


def vocab_blocks(vocab_size: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's block of the vocabulary: ``vocab_size`` split into
    ``world_size`` contiguous blocks whose sizes differ by at most one (the first ones larger)."""
    base, extra = divmod(vocab_size, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def splits_layers(config: LlamaConfig, world_size: int) -> bool:
    """Whether attention and MLP split evenly over ``world_size`` ranks (key/value heads and MLP
    hidden units multiples of it)."""
    return config.num_key_value_heads % world_size == 0 and config.intermediate_size % world_size == 0


def _shard(config: LlamaConfig, weights: Mapping[str, np.ndarray], rank: int, world: int, tp: bool):
    """``(local config, local weights)`` of ``rank``: with ``tp``, its key/value heads (and their
    query heads) and MLP units; the caller's arrays are sliced, never changed."""
    if not tp:
        return config, dict(weights)
    c, d = config, config.head_dim
    kv, inter = c.num_key_value_heads // world, c.intermediate_size // world
    q = kv * c.kv_groups
    local = dataclasses.replace(c, num_attention_heads=q, num_key_value_heads=kv, intermediate_size=inter, head_dim=d)
    rows = {
        "q_proj": slice(rank * q * d, (rank + 1) * q * d),
        "k_proj": slice(rank * kv * d, (rank + 1) * kv * d),
        "gate_proj": slice(rank * inter, (rank + 1) * inter),
    }
    rows["v_proj"], rows["up_proj"] = rows["k_proj"], rows["gate_proj"]
    cols = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj in rows:  # column-parallel: output rows (and bias)
            out[name] = w[rows[proj]]
        elif proj in cols and parts[-1] == "weight":  # row-parallel: input columns; bias after the sum
            out[name] = w[:, cols[proj]]
        else:
            out[name] = w
    return local, out


class _ShardedLlama(_Llama):
    """:class:`.torch_loop._Llama` on one rank: its share of the layers (when ``reduce`` sums
    the row-parallel products over the ranks) and its block of the output projection."""

    def __init__(
        self,
        config: LlamaConfig,
        weights,
        device,
        dtype,
        *,
        rank: int,
        world: int,
        tp: bool,
        reduce: Callable[[torch.Tensor], None],
    ):
        local, local_weights = _shard(config, weights, rank, world, tp)
        self.start, self.end = vocab_blocks(config.vocab_size, world)[rank]
        if not config.tie_word_embeddings:  # only this rank's rows reach the device
            local_weights["lm_head.weight"] = local_weights["lm_head.weight"][self.start : self.end]
        super().__init__(local, local_weights, device, dtype)
        if config.tie_word_embeddings:
            self.head = self.embed[self.start : self.end]  # a view of the replicated embedding
        self.tp, self.reduce = tp, reduce

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """This rank's share of the output or down projection, summed over the ranks (one
        ``all_reduce``) with the bias added after; the whole product where layers replicate."""
        if not self.tp:
            return F.linear(x, w, b)
        y = F.linear(x, w)
        self.reduce(y)  # in place, the sum over the ranks
        return y if b is None else y + b


class _Merge:
    """The rank-order merges of the vocabulary blocks (see the module docstring), on fixed
    buffers; every method is a collective (all ranks call it at the same point)."""

    def __init__(self, rows: int, vocab_size: int, rank: int, world: int, group, device):
        self.world, self.group = world, group
        self.start_of = [s for s, _ in vocab_blocks(vocab_size, world)]
        self.start = self.start_of[rank]
        self.gathered = {k: torch.empty(world * rows, k, dtype=torch.float64, device=device) for k in (2, 4)}

    def _gather(self, parts: torch.Tensor) -> torch.Tensor:
        """``parts`` ``[rows, k]`` float64 of every rank -> ``[world, rows, k]``, rank order."""
        out = self.gathered[parts.shape[1]]
        _all_gather(out, parts, self.group)
        return out.view(self.world, -1, parts.shape[1])

    def _first_max(self, parts: torch.Tensor, value: int) -> torch.Tensor:
        """Per row, the gathered record (``[rows, k]``) of the rank with the largest ``value``
        column, the lowest rank on ties."""
        best = parts[0]
        for r in range(1, self.world):
            best = torch.where((parts[r][:, value] > best[:, value])[:, None], parts[r], best)
        return best

    def argmax(self, x: torch.Tensor, perturbed: torch.Tensor | None):
        """``(global argmax, global max)`` of the rows of ``x`` (the float32 block), and the
        argmax of ``perturbed`` (``None``: the same as the argmax), all ``[rows]``."""
        idx = x.argmax(dim=-1, keepdim=True)  # ties: the lowest id
        pert, pidx = x, idx  # greedy: unused copies
        if perturbed is not None:
            pert, pidx = perturbed, perturbed.argmax(dim=-1, keepdim=True)
        # float64 holds a float32 value and an id below 2**53 exactly: one gather for all four.
        parts = self._gather(
            torch.cat(
                [
                    x.gather(1, idx).double(),
                    (idx + self.start).double(),
                    pert.gather(1, pidx).double(),
                    (pidx + self.start).double(),
                ],
                dim=1,
            )
        )
        best = self._first_max(parts, 0)
        drawn = best[:, 1] if perturbed is None else self._first_max(parts, 2)[:, 3]
        return best[:, 1].long(), best[:, 0].float(), drawn.long()

    def logprob_rank(self, x: torch.Tensor, m: torch.Tensor, token: torch.Tensor):
        """``(logprobs float32, ranks int64)`` of global ids ``token`` under the rows whose
        block is ``x`` (float32), ``m`` the rows' global maximum."""
        local = token - self.start
        here = (local >= 0) & (local < x.shape[1])
        picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
        sums = torch.exp(x - m[:, None]).sum(dim=1)
        parts = self._gather(torch.stack([torch.where(here, picked, 0.0).double(), sums.double()], dim=1))
        owner = torch.zeros_like(token)
        for r in range(1, self.world):  # the rank whose block holds the token
            owner = torch.where(token >= self.start_of[r], r, owner)
        chosen = parts[:, :, 0].gather(0, owner[None])[0].float()
        total = parts[0, :, 1].float()
        for r in range(1, self.world):
            total = total + parts[r, :, 1].float()
        counts = (x >= chosen[:, None]).sum(dim=1).double()
        counted = self._gather(torch.stack([counts, counts], dim=1))
        rank = counted[0, :, 0]
        for r in range(1, self.world):
            rank = rank + counted[r, :, 0]
        return chosen - (m + torch.log(total)), rank.long()


def _all_gather(out: torch.Tensor, part: torch.Tensor, group) -> None:
    """``all_gather`` into one tensor, rank-major (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, part, group=group)


def run_decode_tp(
    config: LlamaConfig,
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
    tp_layers: bool | None = None,
    group=None,
) -> list[RequestResult]:
    """Decode ``requests`` on this rank of a ``torch.distributed`` job, tensor-parallel.

    Call it on every rank of ``group`` (default: the default group; it must be initialised)
    with the same arguments except ``device``, this rank's device (``"cpu"`` for ``gloo``,
    ``"cuda:N"`` for ``nccl``). Arguments and results as in :func:`.torch_loop.run_decode`:
    every rank returns the same results (tokens, forced flags, logprobs and ranks of the raw
    logits, argmax), and the sampling noise is that loop's (a ``torch.Generator`` seeded with
    ``seed``), so greedy and sampled tokens equal the one-process loop's unless two logits lie
    within rounding of each other. ``tp_layers``: split attention and MLP over the ranks
    (default: when :func:`splits_layers`; ``True`` where they do not split is refused).

    Weights: each rank copies its share of ``weights`` (caller-owned numpy arrays, never
    changed) to ``device``. Blocking: collectives on ``device``'s stream; nothing waits for the
    device between steps; outputs are copied to the host once at the end. Arguments are checked
    before any collective (a rank whose arguments are refused raises ``TypeError`` /
    ``ValueError``, and the other ranks then wait in their first collective: pass the same
    arguments everywhere).
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=LlamaConfig, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    if cuda_graph not in (None, True, False):
        raise TypeError(f"cuda_graph must be None, True or False (got {cuda_graph!r})")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "run_decode_tp needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, or a torchrun launch)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world > config.vocab_size:
        raise ValueError(f"world_size {world} exceeds config.vocab_size={config.vocab_size}")
    if tp_layers not in (None, True, False):
        raise TypeError(f"tp_layers must be None, True or False (got {tp_layers!r})")
    even = splits_layers(config, world)
    if tp_layers and not even:
        raise ValueError(
            f"tp_layers=True needs num_key_value_heads ({config.num_key_value_heads}) and "
            f"intermediate_size ({config.intermediate_size}) to be multiples of world_size {world}"
        )
    dev = _torch_device(device)
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device (got device={device!r})")
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        use_graph = dev.type == "cuda" if cuda_graph is None else cuda_graph
        with torch.no_grad(), torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            outputs = _decode_all(
                config,
                weights,
                prompts,
                traces,
                schedule,
                dev,
                on_step,
                getattr(torch, dtype),
                temperature,
                seed,
                use_graph,
                rank,
                world,
                even if tp_layers is None else tp_layers,
                group,
            )
    return collect_results(requests, schedule, outputs)


def _decode_all(
    config,
    weights,
    prompts,
    traces,
    schedule,
    dev,
    on_step,
    dtype,
    temperature,
    seed,
    use_graph,
    rank,
    world,
    tp,
    group,
) -> dict[str, np.ndarray]:
    """Every step of ``schedule`` on this rank; the per-step outputs ``[n_steps, max_batch]`` on the host."""
    c = config

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    model = _ShardedLlama(c, weights, dev, dtype, rank=rank, world=world, tp=tp, reduce=reduce)
    lc = model.config  # this rank's heads
    rows = schedule.max_batch
    kv_len = schedule.kv_positions([len(p) for p in prompts])
    cache = torch.zeros(
        lc.num_hidden_layers, 2, rows, lc.num_key_value_heads, kv_len, lc.head_dim, dtype=dtype, device=dev
    )
    merge = _Merge(rows, c.vocab_size, rank, world, group, dev)
    # The whole vocabulary's noise, as the one-process loop draws it; this rank reads its block.
    buf = _Buffers(schedule, c.vocab_size, dev, temperature, seed)

    def step(state: TraceReplayState) -> None:
        """One decode step of every row on fixed buffers, collectives included."""
        active, positions = buf.positions()
        x = model.decode(cache, buf.last, positions).float()  # this rank's block of the logits
        perturbed = None
        if buf.uniform is not None:
            u = buf.uniform[:, model.start : model.end]
            perturbed = x / temperature - torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
        argmax, m, drawn = merge.argmax(x, perturbed)
        buf.sampled.copy_(drawn)
        state.replay(buf.sampled, buf.idx_mapping)  # local, the same on every rank
        logprobs, ranks = merge.logprob_rank(x, m, buf.sampled)
        buf.record(active, argmax, logprobs, ranks)

    return _run_steps(model, cache, buf, schedule, prompts, traces, c.vocab_size, dev, step, use_graph, on_step)
