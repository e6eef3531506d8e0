"""The PyTorch side of ``score`` (teacher-forced, :mod:`trace_replay_app.scoring`) for every family.

A family's :class:`~.torch_driver.TorchModel` supplies ``hidden(tokens)`` (final-norm hidden
states of a right-padded ``[requests, n]`` batch, causal, no cache) and ``logits(hidden)`` (the
output projection). Per batch: one forward, then the output projection and
:func:`trace_replay_torch.token_logprob_rank` over ``chunk_rows`` scored positions at a time,
so the logits of at most ``chunk_rows`` positions exist at once. Outputs stay on the device
until the end of the call (one copy to the host). On CUDA the forward runs through
``torch.compile`` by default (``compile=``; see :class:`Compiled`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from trace_replay_torch import token_logprob_rank

from ..records import RequestResult, TraceRequest
from ..scoring import ScorePlan, plan_score, score_results
from .torch_driver import TorchFamily, torch_device, upload

__all__ = ["scorer", "score_batches", "Scorable", "Compiled"]

Outputs = tuple[np.ndarray, ...]


class Scorable(Protocol):
    """What scoring needs of a :class:`~.torch_driver.TorchModel`: ``hidden`` and ``logits``."""

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Compiled:
    """``model`` with its forward (``hidden``) through ``torch.compile``: the eager forward of a
    Qwen2.5-0.5B shape at 64 x 1,024 tokens took 216 ms on an H200, compiled 142 ms, for about
    20 s of compilation per new shape (``bench/results/score.json``); the output projection and
    the logprob op stay eager (they are matrix products and one kernel already)."""

    def __init__(self, model: Scorable):
        self.hidden = torch.compile(model.hidden)
        self.logits = model.logits


def score_batches(model: Scorable, plan: ScorePlan, device: torch.device) -> list[Outputs]:
    """Each batch of ``plan`` through ``model`` (a built :class:`~.torch_driver.TorchModel`):
    per batch ``(logprobs, ranks, argmax, entropy[, topk_logprobs, topk_ids])`` over its scored
    rows, on the host (one copy at the end; host-blocking)."""
    pending = []
    with torch.inference_mode():
        for batch in plan.batches:
            hidden = model.hidden(upload(batch.tokens, torch.int64, device))
            hidden = hidden.reshape(-1, hidden.shape[-1])
            rows, targets = upload(batch.rows, torch.int64, device), upload(batch.targets, torch.int64, device)
            m = rows.shape[0]
            t = plan.logprob_temperature
            temps = None if t is None else torch.full((plan.chunk_rows,), t, dtype=torch.float32, device=device)
            k = plan.top_k
            # logprobs, ranks, argmax, entropy (score_results' order), then the top-k pair
            kinds = (torch.float32, torch.int64, torch.int64, torch.float32)
            out = tuple(torch.empty(m, dtype=dt, device=device) for dt in kinds)
            out += tuple(torch.empty((m, k), dtype=dt, device=device) for dt in (torch.float32, torch.int64) if k)
            for s in range(0, m, plan.chunk_rows):
                e = min(m, s + plan.chunk_rows)
                logits = model.logits(hidden[rows[s:e]])
                op_order = (*out[:2], *out[4:], *out[2:4])  # the op's: logprobs, ranks, top-k pair, argmax, entropy
                token_logprob_rank(logits, targets[s:e], top_k=k, argmax=True, entropy=True,
                                   out=tuple(o[s:e] for o in op_order),
                                   temperature=None if temps is None else temps[: e - s])  # fmt: skip
            pending.append(out)
    return [tuple(o.cpu().numpy() for o in out) for out in pending]


def scorer(family: TorchFamily) -> Callable[..., list[RequestResult]]:
    """The ``run_score`` of ``family`` (the contract in :mod:`trace_replay_app.scoring`)."""

    def run_score(
        config: Any,
        weights: Mapping[str, np.ndarray],
        requests: Sequence[TraceRequest],
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_tokens: int = 16384,
        chunk_rows: int = 2048,
        logprobs_mode: str = "raw_logprobs",
        temperature: float = 1.0,
        top_k: int = 0,
        compile: bool | None = None,
    ) -> list[RequestResult]:
        plan = plan_score(config, weights, requests, device=device, dtype=dtype, max_tokens=max_tokens,
                          chunk_rows=chunk_rows, config_type=family.config_type,
                          check_weights=family.check_weights, logprobs_mode=logprobs_mode,
                          temperature=temperature, top_k=top_k)  # fmt: skip
        if compile is not None and not isinstance(compile, bool):
            raise TypeError(f"compile must be a bool or None (got {type(compile).__name__} {compile!r})")
        dev = torch_device(device)
        model: Scorable = family.build(config, weights, dev, getattr(torch, plan.dtype), None)
        if compile if compile is not None else dev.type == "cuda":
            model = Compiled(model)
        outputs = score_batches(model, plan, dev)
        return score_results(requests, plan, outputs)

    return run_score
