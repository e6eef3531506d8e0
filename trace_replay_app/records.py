"""Requests in and results out of a reference decode loop (numpy only; the output records of
every model family and both frameworks)."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["TraceRequest", "RequestResult", "DeviceMemoryError"]


class DeviceMemoryError(RuntimeError):
    """A decode run would need more memory on ``device`` than it has free (``needed`` and ``free``
    in bytes); raised before anything is allocated there."""

    def __init__(self, device: str, needed: int, free: int):
        super().__init__(
            f"the decode run needs {needed / 2**20:,.1f} MiB on {device}, which has {free / 2**20:,.1f} MiB free: "
            "lower --max-batch or run fewer or shorter requests at once"
        )
        self.device, self.needed, self.free = device, needed, free


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request: its ``prompt`` token ids (at least one) and either a ``trace`` (the tokens
    to force, one per decode step; the request decodes exactly ``len(trace)`` tokens) or, with
    ``trace=None``, ``max_new_tokens`` freely decoded tokens."""

    id: str
    prompt: tuple[int, ...]
    trace: tuple[int, ...] | None = None
    max_new_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        """How many tokens the request decodes."""
        return len(self.trace) if self.trace is not None else self.max_new_tokens


@dataclasses.dataclass
class RequestResult:
    """What a decode loop produced for one request, one entry per decoded token.

    ``tokens``: the token that ended up in the sequence (int64); ``forced``: True where the
    token came from the trace; ``logprobs`` (float32) and ``ranks`` (int64) of that token under
    the loop's own, unmodified logits (rank 1 = unique argmax, ties count against the token);
    ``argmax``: the token the model itself would have chosen greedily at that step (int64);
    ``entropy``: the entropy of that step's distribution (float32, natural log), where the run
    computed it (``score``), else None; ``topk_logprobs`` (float32) and ``topk_ids`` (int64),
    ``[tokens, k]``: the ``k`` most likely tokens of each step, most likely first, where the run
    computed them (``score --top-k``), else None.
    """

    id: str
    tokens: np.ndarray
    forced: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    argmax: np.ndarray
    entropy: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
