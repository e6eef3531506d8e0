"""A reference decode loop of a small GPT-2-style model in PyTorch, replaying traces.

:func:`run_decode` decodes a list of :class:`~trace_replay_app.records.TraceRequest` with
a KV cache and continuous batching through slots, greedily (or by temperature sampling), and
forces traced requests onto their traces with :class:`trace_replay_torch.TraceReplayState`;
logprob and rank of every output token come from the unmodified logits through
:func:`trace_replay_torch.token_logprob_rank`. The JAX twin (``jax_loop.run_decode``) runs the
same model on the same schedule (:mod:`trace_replay_app.schedule`), so the two can be compared
token by token. This module is the only one of the family that imports torch.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights
    from trace_replay_app.records import TraceRequest
    from trace_replay_app.models.gpt2.torch_loop import run_decode

    config = GPT2Config()
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trace_replay_core import parse_device
from trace_replay_torch import TraceReplayState, token_logprob_rank

from ...records import RequestResult, TraceRequest
from ...schedule import check_device, check_run, check_sampling, collect_results, plan
from .config import GPT2Config, check_weights

__all__ = ["run_decode"]


def _torch_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (CUDA device 0) or ``"cuda:N"`` -> a torch.device usable here."""
    check_device(device)
    dev = torch.device(parse_device(device))  # ValueError naming the device when there is no such GPU
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: torch sees no CUDA GPU; use device='cpu'")
        index = dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} is not available: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        dev = torch.device("cuda", index)
    return dev


class _GPT2:
    """The model's forward passes on ``device`` in ``dtype`` (weights, activations and KV cache;
    logits are returned as float32), over a slot-indexed KV cache.

    ``cache``: ``[n_layer, 2 (keys, values), max_batch (slots), kv_len, n_head, head_dim]``.
    """

    def __init__(
        self,
        config: GPT2Config,
        weights: Mapping[str, np.ndarray],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.p: dict[str, torch.Tensor] = {
            name: torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(device=device, dtype=dtype)
            for name, w in weights.items()
        }
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, x.shape[-1:], self.p[name + ".weight"], self.p[name + ".bias"], self.config.layer_norm_epsilon
        )

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.addmm(self.p[name + ".bias"], x, self.p[name + ".weight"])  # Conv1D: x @ W + b

    def _layers(self, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The transformer blocks over ``x`` ``[tokens, n_embd]``; ``attend(layer, q, k, v)``
        (each ``[tokens, n_head, head_dim]``) stores keys/values and returns the attention output."""
        c = self.config
        for layer in range(c.n_layer):
            p = f"h.{layer}."
            qkv = self._linear(self._ln(x, p + "ln_1"), p + "attn.c_attn")
            q, k, v = qkv.view(-1, 3, c.n_head, c.head_dim).unbind(1)
            x = x + self._linear(attend(layer, q, k, v).reshape(-1, c.n_embd), p + "attn.c_proj")
            h = F.gelu(self._linear(self._ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")  # gelu_new
            x = x + self._linear(h, p + "mlp.c_proj")
        return x

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.p["wte.weight"][tokens] + self.p["wpe.weight"][positions]

    def prefill(self, cache: torch.Tensor, slot: int, tokens: torch.Tensor) -> None:
        """Store the keys and values of ``tokens`` (``[n]``, positions ``0 .. n-1``) in ``slot``'s cache."""
        n = tokens.shape[0]
        future = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(diagonal=1)

        def attend(layer, q, k, v):
            cache[layer, 0, slot, :n] = k
            cache[layer, 1, slot, :n] = v
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            return torch.einsum("hqk,khd->qhd", probs, v)

        self._layers(self._embed(tokens, torch.arange(n, device=tokens.device)), attend)

    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

        Returns float32 logits ``[max_batch, vocab_size]``. Rows attend to cache positions
        ``<= positions[b]``; an empty row computes garbage that no one reads.
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        hidden = (torch.arange(cache.shape[3], device=tokens.device) > positions[:, None])[:, None, :]

        def attend(layer, q, k, v):
            cache[layer, 0, rows, positions] = k
            cache[layer, 1, rows, positions] = v
            scores = torch.einsum("bhd,bthd->bht", q, cache[layer, 0]) * self.scale
            probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)  # hidden: [rows, 1, kv_len]
            return torch.einsum("bht,bthd->bhd", probs, cache[layer, 1])

        h = self._ln(self._layers(self._embed(tokens, positions), attend), "ln_f")
        return (h @ self.p["wte.weight"].T).float()


def run_decode(
    config: GPT2Config,
    weights: Mapping[str, np.ndarray],
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    dtype: str = "float32",
    temperature: float = 0.0,
    seed: int = 0,
) -> list[RequestResult]:
    """Decode ``requests`` with the model ``config``/``weights``, replaying their traces.

    ``weights``: float numpy arrays named as in :func:`~trace_replay_app.models.gpt2.param_shapes`
    (copied to ``device`` in ``dtype``, ``"float32"`` or ``"bfloat16"``, the compute dtype; the
    caller's arrays are not changed). ``temperature``: 0 (default) decodes greedily; above 0,
    untraced rows sample from ``softmax(logits / temperature)`` (Gumbel-max with noise from a
    ``torch.Generator`` seeded with ``seed`` on ``device``: the same arguments give the same
    tokens). ``requests``: each
    decodes ``request.new_tokens`` tokens; a traced one is forced onto its trace at every step.
    ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. ``max_batch``: slots (and batch rows)
    decoding at once; requests join in input order as slots free up (the schedule of
    :func:`trace_replay_app.schedule.plan`). ``on_step(k)`` is called on the host after
    each decode step is queued, with the number of tokens that step decodes.

    Returns one :class:`RequestResult` per request, in the order of ``requests``: the tokens
    (the trace for a traced request), ``forced`` (True inside the trace), the logprob and rank
    of each token under the unmodified float32 logits (before temperature), and the greedy
    ``argmax`` (ties: lowest id). Matrix products follow torch's float32 settings (full float32 unless the caller
    allowed TF32, e.g. ``torch.backends.cuda.matmul.allow_tf32``).

    Each step: feed every active row's last token at its position, logits, sample (greedy:
    every row -1, "take the argmax"), replay in place (the step of a slot is ``total_len -
    prompt_len``, read on the device), logprob/rank/argmax in one pass over the logits (rows
    still at -1 scored as, and then set to, their argmax), append. Nothing waits for the device
    between steps; outputs stay on the device until one copy to the host at the end. Arguments
    are checked before anything runs (``TypeError`` / ``ValueError`` naming the argument); a
    rejected call does nothing.
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=GPT2Config, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    dev = _torch_device(device)
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        with torch.no_grad():
            outputs = _decode_all(
                config, weights, prompts, traces, schedule, dev, on_step, getattr(torch, dtype), temperature, seed
            )
    return collect_results(requests, schedule, outputs)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)``: Gumbel-max, noise from ``generator``."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
    return (logits / temperature + gumbel).argmax(dim=-1)


def _decode_all(
    config, weights, prompts, traces, schedule, dev, on_step, dtype, temperature, seed
) -> dict[str, np.ndarray]:
    """Run every step of ``schedule``; return the per-step outputs ``[n_steps, max_batch]`` on the host."""
    model = _GPT2(config, weights, dev, dtype)
    rows, steps = schedule.max_batch, schedule.n_steps
    kv_len = schedule.kv_positions([len(p) for p in prompts])
    cache = torch.zeros(config.n_layer, 2, rows, kv_len, config.n_head, config.head_dim, device=dev, dtype=dtype)
    generator = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    prompt_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # per slot, read by replay
    total_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # prompt + tokens decoded so far
    last = torch.zeros(rows, dtype=torch.int64, device=dev)  # the token each row feeds next
    # Prompts and schedule go to the device once, up front (a copy from pageable memory waits for it).
    idx_all = torch.from_numpy(schedule.idx_mapping).to(dev)
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    prompt_ids = torch.from_numpy(np.concatenate(prompts)).to(dev)
    idx_mapping = torch.empty(rows, dtype=torch.int32, device=dev)  # fixed buffers: replay binds them once
    sampled = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    ranks = torch.empty(rows, dtype=torch.int64, device=dev)
    argmax = torch.empty(rows, dtype=torch.int64, device=dev)
    greedy = torch.empty(rows, dtype=torch.bool, device=dev)  # rows that take their argmax
    out = {
        "tokens": torch.empty(steps, rows, dtype=torch.int64, device=dev),
        "argmax": torch.empty(steps, rows, dtype=torch.int64, device=dev),
        "logprobs": torch.empty(steps, rows, dtype=torch.float32, device=dev),
        "ranks": torch.empty(steps, rows, dtype=torch.int64, device=dev),
    }
    max_trace = max((len(t) for t in traces if t is not None), default=1)
    per_step = schedule.tokens_per_step.tolist()
    with TraceReplayState(
        rows, max_trace, device=dev, total_len=total_len, prompt_len=prompt_len, vocab_size=config.vocab_size
    ) as state:
        for step in range(steps):
            for i in schedule.admitted(step).tolist():
                slot, prompt = int(schedule.slot[i]), prompts[i]
                if len(prompt) > 1:
                    model.prefill(cache, slot, prompt_ids[offsets[i] : offsets[i + 1] - 1])
                prompt_len[slot] = len(prompt)
                total_len[slot] = len(prompt)
                last[slot] = int(prompt[-1])
                state.add_request(slot, traces[i])  # None: untraced (forgets the slot's old trace)
            state.apply_staged_writes()
            idx_mapping.copy_(idx_all[step])
            active = idx_mapping >= 0
            positions = torch.where(active, total_len.long() - 1, 0)  # empty rows: anywhere in range
            logits = model.decode(cache, last, positions)
            if generator is None:
                sampled.fill_(-1)  # -1: greedy, the argmax below
            else:
                sampled.copy_(_sample(logits, temperature, generator))
            state.replay(sampled, idx_mapping)  # traced rows take their trace token, in place
            # From the unmodified logits, one pass; argmax ties: the lowest id, as torch.argmax.
            token_logprob_rank(logits, sampled, argmax=True, out=(logprobs, ranks, argmax))
            if generator is None:
                torch.lt(sampled, 0, out=greedy)
                torch.where(greedy, argmax, sampled, out=sampled)
            out["tokens"][step] = sampled
            out["argmax"][step] = argmax
            out["logprobs"][step] = logprobs
            out["ranks"][step] = ranks
            total_len += active
            last = torch.where(active, sampled, last)
            if on_step is not None:
                on_step(per_step[step])
        return {name: t.cpu().numpy() for name, t in out.items()}
