"""Seeded sets of requests for parity tests of any model (numpy only), by kind.

- ``"random"``: prompts of 1 to 12 tokens and 1 to 16 new tokens, about half traced with
  random tokens; the first request has a one-token prompt (nothing to prefill, and its first
  decode step is at position 0).
- ``"ties"``: requests that repeat one another and tokens that repeat inside a request: the
  same prompt decoded freely twice and traced twice (rows of one batch that must give the
  same bits), a prompt of one token repeated and a trace of one token repeated (attention
  over keys that differ only by their position).
- ``"long"``: requests that fill the model's ``n_positions`` (a one-token prompt traced to
  the end, a prompt of half the positions traced to the end, one decoded freely to the end).
- ``"file"``: the requests of a trace file (:func:`trace_replay_app.traces.read_traces`),
  checked against the model's limits.

Each set is a function of its kind, the model's ``vocab_size`` and ``n_positions``, and the
seed: the same arguments give the same requests. :class:`TraceSet` is what the pytest plugin's
``trace_set`` fixture gives a test (:mod:`trace_replay_app.pytest_plugin`).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from .records import TraceRequest
from .traces import read_traces

__all__ = ["KINDS", "TraceSet"]

KINDS = ("random", "ties", "long")


@dataclasses.dataclass(frozen=True)
class TraceSet:
    """A set of requests not yet drawn: its ``kind`` (one of :data:`KINDS`, or ``"file"``
    with ``path``), its ``seed`` and, for ``"random"``, ``n`` requests."""

    kind: str
    seed: int = 0
    path: str | None = None
    n: int = 8

    def __post_init__(self):
        if self.kind not in (*KINDS, "file"):
            raise ValueError(f"kind must be one of {', '.join(KINDS)} or 'file' (got {self.kind!r})")
        if (self.kind == "file") != (self.path is not None):
            raise ValueError(f"path is given with kind 'file' only (got kind={self.kind!r}, path={self.path!r})")

    def requests(self, vocab_size: int, n_positions: int) -> list[TraceRequest]:
        """The set's requests for a model of ``vocab_size`` tokens whose requests may hold
        ``n_positions`` prompt + decoded tokens (at least 4). ``ValueError`` for limits too
        small, or a trace file that does not fit them (:class:`~trace_replay_app.traces.TraceFileError`)."""
        if vocab_size < 2 or n_positions < 4:
            raise ValueError(
                f"a trace set needs vocab_size >= 2 and n_positions >= 4 (got {vocab_size}, {n_positions})"
            )
        if self.kind == "file":
            assert self.path is not None
            return read_traces(self.path, types.SimpleNamespace(vocab_size=vocab_size, n_positions=n_positions))
        rng = np.random.default_rng([self.seed, KINDS.index(self.kind)])
        make = {"random": _random, "ties": _ties, "long": _long}[self.kind]
        return make(rng, vocab_size, n_positions, self.n)

    @property
    def id(self) -> str:
        """A short name for test ids: the kind, and the seed or the file name."""
        return f"file-{self.path}" if self.kind == "file" else f"{self.kind}-seed{self.seed}"


def _tokens(rng, vocab_size: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab_size, n))


def _random(rng, vocab_size: int, n_positions: int, n: int) -> list[TraceRequest]:
    out = []
    for i in range(n):
        p = 1 if i == 0 else int(rng.integers(1, min(12, n_positions // 2) + 1))
        k = int(rng.integers(1, min(16, n_positions - p) + 1))
        prompt = _tokens(rng, vocab_size, p)
        if i == 0 or rng.random() < 0.5:
            out.append(TraceRequest(f"random{i}", prompt, _tokens(rng, vocab_size, k)))
        else:
            out.append(TraceRequest(f"random{i}", prompt, max_new_tokens=k))
    return out


def _ties(rng, vocab_size: int, n_positions: int, n: int) -> list[TraceRequest]:
    k = min(8, n_positions // 2)
    prompt, trace = _tokens(rng, vocab_size, k), _tokens(rng, vocab_size, k)
    token, other = (int(t) for t in rng.choice(vocab_size, 2, replace=False))
    return [
        TraceRequest("same-free-a", prompt, max_new_tokens=k),
        TraceRequest("same-traced-a", prompt, trace),
        TraceRequest("same-free-b", prompt, max_new_tokens=k),
        TraceRequest("same-traced-b", prompt, trace),
        TraceRequest("repeated-prompt", (token,) * k, max_new_tokens=k),
        TraceRequest("repeated-trace", (other,), (token,) * k),
    ]


def _long(rng, vocab_size: int, n_positions: int, n: int) -> list[TraceRequest]:
    half = n_positions // 2
    return [
        TraceRequest("long-traced", _tokens(rng, vocab_size, 1), _tokens(rng, vocab_size, n_positions - 1)),
        TraceRequest("long-prompt", _tokens(rng, vocab_size, half), _tokens(rng, vocab_size, n_positions - half)),
        TraceRequest("long-free", _tokens(rng, vocab_size, 2), max_new_tokens=n_positions - 2),
    ]
