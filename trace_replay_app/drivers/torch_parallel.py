"""Tensor parallelism over the ranks of a ``torch.distributed`` job: an option of the torch decode driver.

``run_decode(..., tensor_parallel=TensorParallel(group=None, layers=None))`` (a family's
run_decode from :func:`trace_replay_app.drivers.torch_driver.decoder`) runs the one driver
on this rank, one device per rank (``gloo`` on CPUs, ``nccl`` on GPUs):

- Vocabulary-parallel output projection: rank ``r`` holds rows ``[start_r, end_r)`` of the
  output projection and computes that block of every row's logits (:func:`vocab_blocks`: as
  even as ``vocab_size`` allows).
- Tensor-parallel layers where the family splits them (:class:`Shard` ``.layers``; a family
  says when with its ``splits_layers(config, world)``): each rank holds its share of the heads
  and MLP units; the row-parallel products are summed with ``Shard.reduce`` (one
  ``all_reduce``), their biases added after it. Otherwise every rank runs the whole layer stack.
- :class:`Merge`: the vocabulary blocks merged per row in rank order (strict ``>``: ties go to
  the lower rank, so to the lowest id): each block's maximum and argmax (and, when sampling, the
  maximum of ``logits / T + gumbel`` and where it is) gathered with ``all_gather``; every rank
  then holds the same ``sampled`` and replays it with its own replay state. Logprob and rank of
  the token from the unmodified logits: a second gather brings each block's candidate for the
  chosen logit and its sum of ``exp(x - M)``, a third each block's count of ``x >= chosen``;
  sums and counts are added in rank order, so the bits depend on the logits and the number of
  ranks only. Logits are taken to be finite.

Cost per decode step on top of the model: two ``all_reduce`` of ``[rows, hidden]`` per layer
(tensor-parallel layers), three ``all_gather`` of a few values per row. On CUDA the step,
collectives included, is captured in the driver's CUDA graph (NCCL collectives are capturable).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorParallel", "Shard", "Merge", "vocab_blocks", "shard_for"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel option of the torch driver. ``group``: the ``torch.distributed``
    process group (``None``: the default group; it must be initialised). ``layers``: split
    attention and MLP over the ranks (``None``: where the family's sizes split evenly;
    ``True`` where they do not is refused; ``False``: replicate the layers, split the
    vocabulary only). Call the run on every rank with the same arguments but ``device``."""

    group: Any = None
    layers: bool | None = None


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one rank of a tensor-parallel run holds: ``rank`` of ``world``, the vocabulary
    block ``[start, end)`` of the output projection, whether its layers are split
    (``layers``), and ``reduce(t)``, the in-place sum over the ranks of a row-parallel product."""

    rank: int
    world: int
    start: int
    end: int
    layers: bool
    reduce: Callable[[torch.Tensor], None]


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


def shard_for(option: Any, config: Any, splits_layers: Callable[[Any, int], bool]) -> Shard:
    """This rank's :class:`Shard` of a run with ``option`` (a :class:`TensorParallel`); the
    checks of the option, before any collective. ``splits_layers(config, world)``: the family's
    answer to whether its layers split evenly. Host-only."""
    if not isinstance(option, TensorParallel):
        raise TypeError(f"tensor_parallel must be a TensorParallel or None (got {type(option).__name__})")
    if option.layers not in (None, True, False):
        raise TypeError(f"tensor_parallel.layers must be None, True or False (got {option.layers!r})")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, or a torchrun launch)"
        )
    group = option.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world > config.vocab_size:
        raise ValueError(f"world_size {world} exceeds config.vocab_size={config.vocab_size}")
    even = splits_layers(config, world)
    if option.layers and not even:
        raise ValueError(f"tensor_parallel.layers=True needs layer sizes that split over world_size {world}")

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    start, end = vocab_blocks(config.vocab_size, world)[rank]
    return Shard(rank, world, start, end, even if option.layers is None else option.layers, reduce)


class Merge:
    """The rank-order merges of the vocabulary blocks (see the module docstring), on fixed
    buffers; every method is a collective (all ranks call it at the same point)."""

    def __init__(self, rows: int, vocab_size: int, shard: Shard, group: Any, device: torch.device):
        self.world, self.group = shard.world, group
        self.start_of = [s for s, _ in vocab_blocks(vocab_size, shard.world)]
        self.start, self.end = shard.start, shard.end
        self.gathered = {k: torch.empty(self.world * rows, k, dtype=torch.float64, device=device) for k in (2, 4)}

    def _gather(self, parts: torch.Tensor) -> torch.Tensor:
        """``parts`` ``[rows, k]`` float64 of every rank -> ``[world, rows, k]``, rank order."""
        out = self.gathered[parts.shape[1]]
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, parts, group=self.group)
        return out.view(self.world, -1, parts.shape[1])

    def _first_max(self, parts: torch.Tensor, value: int) -> torch.Tensor:
        """Per row, the gathered record (``[rows, k]``) of the rank with the largest ``value``
        column, the lowest rank on ties."""
        best = parts[0]
        for r in range(1, self.world):
            best = torch.where((parts[r][:, value] > best[:, value])[:, None], parts[r], best)
        return best

    def argmax(self, x: torch.Tensor, perturbed: torch.Tensor | None):
        """``(global argmax, global max, drawn)`` of the rows of ``x`` (this rank's float32
        block); ``drawn``: the argmax of ``perturbed`` (``None``: the argmax), all ``[rows]``."""
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
