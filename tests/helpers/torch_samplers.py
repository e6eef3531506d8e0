"""Test helpers: one greedy sampler written twice (eager methods, registered ops), and a decode
loop that admits and removes requests between steps, for comparing the two forms step by step."""

from __future__ import annotations

import numpy as np
import torch

from trace_replay_core import replay_reference
from trace_replay_torch import replay_op, token_logprob_rank, token_logprob_rank_op


def eager_sampler(state, logits, idx_mapping):
    """Greedy sample, replay, score: the direct eager path."""
    sampled = torch.argmax(logits, dim=-1)
    state.replay(sampled, idx_mapping)
    logprobs, ranks = token_logprob_rank(logits, sampled)
    return sampled, logprobs, ranks


def natural_sampler(state, logits, idx_mapping, temperature, noise, step=None):
    """A sampler written the natural way, with the state's own methods: temperature, top-k 8,
    an exponential race (Gumbel-max: ``noise`` is ``Exp(1)`` draws made outside), replay (or
    ``replay_at_step`` with ``step``), then logprobs with top-4, greedy tokens and entropy.
    Returns the drawn tokens before replay, after it, and the logprob result."""
    scaled = logits.float() / temperature[:, None]
    kth = torch.topk(scaled, 8, dim=-1).values[:, -1:]
    probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    drawn = (probs / noise).argmax(dim=-1)
    sampled = drawn.clone()
    if step is None:
        state.replay(sampled, idx_mapping)
    else:
        state.replay_at_step(sampled, idx_mapping, step)
    return drawn, sampled, token_logprob_rank(logits, sampled, top_k=4, argmax=True, entropy=True)


def op_sampler(state, logits, idx_mapping):
    """The same sampler through the registered ops: what ``torch.compile`` traces."""
    sampled = torch.argmax(logits, dim=-1)
    replay_op(state, sampled, idx_mapping)
    logprobs, ranks = token_logprob_rank_op(logits, sampled)
    return sampled, logprobs, ranks


class DecodeLoop:
    """A continuous-batching loop over a ``TraceReplayState`` with its host mirror.

    The state's bound ``total_len``/``prompt_len`` live on ``device`` and are updated in place
    between steps (as a real loop does); ``table``/``lens`` mirror what is committed.
    """

    def __init__(self, rng, state, total_len, prompt_len, *, batch: int, vocab: int):
        self.rng, self.state, self.batch, self.vocab = rng, state, batch, vocab
        self.total_len, self.prompt_len = total_len, prompt_len
        slots, length = state.table.max_slots, state.table.max_trace_len
        self.table = np.zeros((slots, length), np.int32)
        self.lens = np.zeros(slots, np.int32)
        self.total = np.zeros(slots, np.int64)
        self.prompt = np.zeros(slots, np.int64)
        self.forced = 0

    def admit_and_commit(self) -> None:
        """A few slots get a new request (traced or not, with its own prompt), one may finish;
        then the commit, on the current stream."""
        slots, length = self.table.shape
        for slot in self.rng.choice(slots, size=int(self.rng.integers(1, 4)), replace=False):
            slot = int(slot)
            self.prompt[slot] = int(self.rng.integers(1, 20))
            self.total[slot] = self.prompt[slot] + int(self.rng.integers(-1, 3))
            if self.rng.random() < 0.75:
                trace = self.rng.integers(0, self.vocab, int(self.rng.integers(1, length + 1)))
                self.state.add_request(slot, trace)
                self.table[slot, : len(trace)] = trace
                self.lens[slot] = len(trace)
            else:
                self.state.add_request(slot, None)
                self.lens[slot] = 0
        if self.rng.random() < 0.3:
            slot = int(self.rng.integers(0, slots))
            self.state.remove_request(slot)
            self.lens[slot] = 0
        self.state.apply_staged_writes()
        self.prompt_len.copy_(torch.from_numpy(self.prompt))
        self.total_len.copy_(torch.from_numpy(self.total))

    def step_inputs(self, dtype=torch.float32):
        """Fresh logits (distinct values per row) and a batch of slots with -1 padding."""
        device = self.total_len.device
        slots = self.table.shape[0]
        idx = self.rng.integers(0, slots, self.batch)
        idx[self.rng.random(self.batch) < 0.15] = -1
        logits = torch.from_numpy(self.rng.standard_normal((self.batch, self.vocab)).astype(np.float32))
        return logits.to(device, dtype), torch.from_numpy(idx.astype(np.int32)).to(device)

    def expected(self, sampled_before, idx) -> np.ndarray:
        """The reference replay of this step onto what the sampler drew."""
        base = sampled_before.cpu().numpy()
        out = replay_reference(base, idx.cpu().numpy(), self.table, self.lens, self.total, self.prompt)
        self.forced += int((out != base).sum())
        return out

    def advance(self) -> None:
        self.total += 1
        self.total_len.copy_(torch.from_numpy(self.total))
