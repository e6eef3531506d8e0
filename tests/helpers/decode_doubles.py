"""Models that keep the decode drivers' protocols with arithmetic a test can predict exactly.

A "position sum" model over a vocabulary of :data:`VOCAB` tokens: the logits of row ``b``
decoding at position ``p`` rank every token by its distance (mod ``VOCAB``) from
``next = (sum of the slot's tokens at positions 0 .. p + OFFSET * p) % VOCAB``, so greedy
decoding picks ``next`` and every logit is a distinct small integer. Keys and values are the
tokens themselves, kept per slot and position, so a model that reads a wrong position, a
stale slot or a padding token decodes other tokens. :func:`reference` gives the tokens and
logprobs any correct driver must produce. The torch model keeps its cache on itself
(``new_cache`` returns ``None``); the JAX model's cache is an int32 array ``[slots, kv_len]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

VOCAB = 37
OFFSET = 3
N_POSITIONS = 40


def _logits_of(nxt, vocab: int, arange):
    """``-((v - next) % vocab)`` for every token ``v``: 0 at ``next``, distinct below it."""
    return -((arange[None, :] - nxt[:, None]) % vocab)


class SumTorch:
    """The torch position-sum model on ``device``; its cache lives on the model."""

    vocab_size, n_positions = VOCAB, N_POSITIONS

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.tokens: torch.Tensor | None = None
        self.calls = {"new_cache": 0, "prefill": 0, "decode": 0}

    def new_cache(self, slots: int, kv_len: int) -> None:
        self.calls["new_cache"] += 1
        self.tokens = torch.full((slots, kv_len), 10_000, dtype=torch.int64, device=self.device)  # garbage
        return None

    def prefill(self, cache, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        assert cache is None and self.tokens is not None
        self.calls["prefill"] += 1
        self.tokens[slots, : tokens.shape[1]] = tokens

    def decode(self, cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert cache is None and self.tokens is not None
        self.calls["decode"] += 1
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.tokens[rows, positions] = tokens
        seen = torch.arange(self.tokens.shape[1], device=tokens.device)[None, :] <= positions[:, None]
        nxt = ((self.tokens * seen).sum(dim=1) + OFFSET * positions) % VOCAB
        return _logits_of(nxt, VOCAB, torch.arange(VOCAB, device=tokens.device)).float()


@dataclasses.dataclass(frozen=True)
class SumJax:
    """The JAX position-sum model (pure functions; parameters ``{"offset": OFFSET}``)."""

    vocab_size: int = VOCAB
    n_positions: int = N_POSITIONS

    def new_cache(self, slots: int, kv_len: int):
        return jnp.full((slots, kv_len), 10_000, jnp.int32)

    def prefill(self, params, tokens):
        return tokens

    def write(self, cache, kv, slot):
        return jax.lax.dynamic_update_slice(cache, kv[None].astype(cache.dtype), (slot, 0))

    def decode(self, params, cache, tokens, positions):
        rows = jnp.arange(tokens.shape[0])
        cache = cache.at[rows, positions].set(tokens)
        seen = jnp.arange(cache.shape[1])[None, :] <= positions[:, None]
        nxt = (jnp.where(seen, cache, 0).sum(axis=1) + params["offset"] * positions) % self.vocab_size
        return _logits_of(nxt, self.vocab_size, jnp.arange(self.vocab_size)).astype(jnp.float32), cache


PARAMS = {"offset": np.int32(OFFSET)}


def reference(prompt: Sequence[int], trace: Sequence[int] | None, new_tokens: int):
    """``(tokens, logprobs, argmax)`` any correct driver gives the request (greedy; forced
    onto ``trace`` when given), float64 logprobs."""
    seq = list(prompt)
    tokens, logprobs, argmax = [], [], []
    arange = np.arange(VOCAB)
    for k in range(new_tokens):
        p = len(seq) - 1
        nxt = (sum(seq) + OFFSET * p) % VOCAB
        logits = _logits_of(np.array([nxt]), VOCAB, arange)[0].astype(np.float64)
        tok = nxt if trace is None else trace[k]
        logz = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
        tokens.append(tok)
        logprobs.append(logits[tok] - logz)
        argmax.append(nxt)
        seq.append(tok)
    return np.array(tokens), np.array(logprobs), np.array(argmax)
