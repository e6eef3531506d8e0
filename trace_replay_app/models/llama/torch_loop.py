"""The Llama-family decode loop in PyTorch, replaying traces; on CUDA each decode step is one CUDA graph.

:func:`run_decode` decodes :class:`~trace_replay_app.records.TraceRequest` with a KV cache and
continuous batching through slots (the shared schedule, :mod:`trace_replay_app.schedule`),
forces traced requests onto their traces with :class:`trace_replay_torch.TraceReplayState`,
and takes the logprob and rank of every token from the unmodified logits with
:func:`trace_replay_torch.token_logprob_rank`. The JAX twin is ``jax_loop.run_decode``.

On CUDA the fixed-shape decode step of all slots (model, sampling, replay, one pass of
logprob/rank/argmax over the logits, the appends to the outputs) is captured once in a CUDA
graph and replayed each step; prefill, admission and ``apply_staged_writes`` run eagerly
between replays. On the CPU the same step runs eagerly.

Example (CPU; ``device="cuda"`` on a GPU)::

    from trace_replay_app.models.llama.config import default_config, seeded_weights
    from trace_replay_app.models.llama.torch_loop import run_decode
    from trace_replay_app.records import TraceRequest

    config = default_config("llama")
    requests = [TraceRequest("a", prompt=(1, 2, 3), trace=(7, 8, 9)),
                TraceRequest("b", prompt=(4,), max_new_tokens=5)]
    a, b = run_decode(config, seeded_weights(config), requests)
    assert a.tokens.tolist() == [7, 8, 9] and a.forced.all()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trace_replay_core import parse_device
from trace_replay_torch import TraceReplayState, token_logprob_rank

from ...records import RequestResult, TraceRequest
from ...schedule import check_device, check_run, check_sampling, collect_results, plan
from .config import LlamaConfig, check_weights, inv_freq

__all__ = ["run_decode"]

_PREFILL_TOKENS = 16384  # padded prompt tokens per batched prefill call


def _torch_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (CUDA device 0) or ``"cuda:N"`` -> a torch.device usable here."""
    check_device(device)
    dev = torch.device(parse_device(device))  # ValueError naming the device when there is no such GPU
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available: torch sees no CUDA GPU; use device='cpu'")
    return dev


def _tensor(w: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(device=device, dtype=dtype)


def _upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a new tensor on ``device``; on CUDA through pinned memory, queued on the
    current stream without waiting for the device (a pageable copy would wait for every step
    queued before it)."""
    host = torch.as_tensor(np.asarray(values)).to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, rounded to ``x``'s dtype, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` (halves rotated, as transformers)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class _Llama:
    """The model's forward passes on ``device`` in ``dtype`` over a slot-indexed KV cache.

    ``cache``: ``[layers, 2 (keys, values), slots, kv_heads, kv_len, head_dim]``. The q/k/v
    and gate/up projections are concatenated once here (one matrix product each per layer).
    """

    def __init__(
        self, config: LlamaConfig, weights: Mapping[str, np.ndarray], device: torch.device, dtype: torch.dtype
    ):
        c, self.config, self.dtype = config, config, dtype

        def get(name):
            return _tensor(weights[name], device, dtype) if name in weights else None

        def cat(names):
            parts = [get(n) for n in names]
            return None if parts[0] is None else torch.cat(parts)

        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(
                {
                    "ln1": get(p + "input_layernorm.weight"),
                    "ln2": get(p + "post_attention_layernorm.weight"),
                    "qkv_w": cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                    "qkv_b": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                    "o_w": get(a + "o_proj.weight"),
                    "o_b": get(a + "o_proj.bias"),
                    "q_norm": get(a + "q_norm.weight"),
                    "k_norm": get(a + "k_norm.weight"),
                    "gu_w": cat([m + "gate_proj.weight", m + "up_proj.weight"]),
                    "gu_b": cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                    "down_w": get(m + "down_proj.weight"),
                    "down_b": get(m + "down_proj.bias"),
                }
            )
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.inv_freq = torch.from_numpy(inv_freq(c)).to(device)
        self.scale = c.head_dim**-0.5
        d = c.head_dim
        self.split = [c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d]

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable) -> torch.Tensor:
        """Hidden states after the final norm, ``[tokens, hidden]``; ``attend(layer, q, k, v)``
        (``[tokens, heads or kv_heads, head_dim]``, rotated) stores keys/values and returns the
        attention output ``[tokens, heads * head_dim]``."""
        c, eps = self.config, self.config.rms_norm_eps
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # float32, as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        x = self.embed[tokens]
        n = x.shape[0]
        for i, w in enumerate(self.layers):
            h = _rms(x, w["ln1"], eps)
            q, k, v = F.linear(h, w["qkv_w"], w["qkv_b"]).split(self.split, dim=-1)
            q = q.reshape(n, c.num_attention_heads, c.head_dim)
            k = k.reshape(n, c.num_key_value_heads, c.head_dim)
            v = v.reshape(n, c.num_key_value_heads, c.head_dim)
            if c.qk_norm:
                q, k = _rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)
            x = x + self._row_parallel(attend(i, _rotate(q, cos, sin), _rotate(k, cos, sin), v), w["o_w"], w["o_b"])
            gate, up = F.linear(_rms(x, w["ln2"], eps), w["gu_w"], w["gu_b"]).chunk(2, dim=-1)
            x = x + self._row_parallel(F.silu(gate) * up, w["down_w"], w["down_b"])
        return _rms(x, self.norm, eps)

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The output and down projections, ``x @ w.T + b`` (the tensor-parallel loop sums them
        over its ranks here)."""
        return F.linear(x, w, b)

    def prefill(self, cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store the keys and values of ``tokens`` ``[requests, n]`` (positions ``0 .. n-1``,
        right-padded) in the caches of ``slots`` ``[requests]``. Padding positions hold
        garbage that a decode step overwrites before any query reads it."""
        c = self.config
        r, n = tokens.shape
        pos = torch.arange(n, device=tokens.device)
        causal = pos[None, :] <= pos[:, None]  # [query, key]

        def attend(layer, q, k, v):
            q, k, v = (t.reshape(r, n, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))
            cache[layer, 0, slots, :, :n] = k
            cache[layer, 1, slots, :, :n] = v
            k, v = k.repeat_interleave(c.kv_groups, dim=1), v.repeat_interleave(c.kv_groups, dim=1)
            window = c.window(layer)
            mask = causal & (pos[None, :] > pos[:, None] - window) if window else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
            return out.transpose(1, 2).reshape(r * n, -1)

        self._layers(tokens.reshape(-1), pos.repeat(r), attend)

    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache.

        Returns logits ``[rows, vocab]`` in the compute dtype. Rows attend to cache positions
        ``<= positions[b]`` (and inside the layer's window); an empty row computes garbage
        that no one reads. Fixed shapes, no host sync: capturable in a CUDA graph.
        """
        c = self.config
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        kpos = torch.arange(cache.shape[4], device=tokens.device)
        masks = {}
        for layer in range(c.num_hidden_layers):
            w = c.window(layer)
            if w not in masks:
                hidden = kpos[None, :] > positions[:, None]
                if w:
                    hidden = hidden | (kpos[None, :] <= positions[:, None] - w)
                masks[w] = hidden[:, None, None, :]  # [rows, 1, 1, kv_len]

        def attend(layer, q, k, v):
            keys, values = cache[layer, 0], cache[layer, 1]  # [rows, kv_heads, kv_len, head_dim]
            keys[rows, :, positions] = k
            values[rows, :, positions] = v
            qg = q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # [rows, kv_heads, groups, kv_len]
            probs = scores.float().masked_fill(masks[c.window(layer)], float("-inf")).softmax(dim=-1)
            return torch.matmul(probs.to(self.dtype), values).reshape(q.shape[0], -1)

        return F.linear(self._layers(tokens, positions, attend), self.head)


def run_decode(
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
) -> list[RequestResult]:
    """Decode ``requests`` with the Llama-family model ``config``/``weights``, replaying traces.

    ``weights``: float numpy arrays named as in :func:`.config.param_shapes` (copied to
    ``device`` in ``dtype``, ``"float32"`` or ``"bfloat16"``; the caller's arrays are not
    changed). ``requests``: each decodes ``request.new_tokens`` tokens; a traced one is forced
    onto its trace at every step. ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    ``max_batch``: slots decoding at once, on the schedule of :func:`trace_replay_app.schedule.plan`.
    ``temperature``: 0 decodes greedily (ties: lowest id); above 0, untraced rows sample from
    ``softmax(logits / temperature)`` (Gumbel-max, uniform noise from a ``torch.Generator``
    seeded with ``seed`` on ``device``: the same arguments give the same tokens).
    ``on_step(k)`` is called on the host after each step is queued, with the tokens it decodes.
    ``cuda_graph``: capture the decode step in a CUDA graph (default: on CUDA devices; the
    eager step gives the same results).

    Returns one :class:`RequestResult` per request, in request order: tokens, ``forced``, the
    logprob and rank of each token under the unmodified logits (the model's logits in the
    compute dtype; logprobs accumulated in float32, before temperature), and the greedy
    ``argmax``. Matrix products follow torch's float32 settings (full float32 unless the
    caller allowed TF32). Nothing waits for the device between steps; outputs are copied to
    the host once at the end. Arguments are checked before anything runs (``TypeError`` /
    ``ValueError`` naming the argument); a rejected call does nothing.
    """
    prompts, traces = check_run(
        config, weights, requests, max_batch, on_step, config_type=LlamaConfig, check_weights=check_weights
    )
    temperature = check_sampling(dtype, temperature, seed)
    if cuda_graph not in (None, True, False):
        raise TypeError(f"cuda_graph must be None, True or False (got {cuda_graph!r})")
    dev = _torch_device(device)
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device (got device={device!r})")
    schedule = plan([r.new_tokens for r in requests], max_batch)
    outputs = None
    if schedule.n_steps:
        with torch.no_grad():
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
                dev.type == "cuda" if cuda_graph is None else cuda_graph,
            )
    return collect_results(requests, schedule, outputs)


def _prefill_groups(admitted: list[int], prompts) -> list[list[int]]:
    """Requests (indices) that prefill together: consecutive, at most ``_PREFILL_TOKENS``
    padded tokens per group; prompts of one token have nothing to prefill."""
    groups, group, longest = [], [], 0
    for i in admitted:
        n = len(prompts[i]) - 1
        if n <= 0:
            continue
        if group and max(longest, n) * (len(group) + 1) > _PREFILL_TOKENS:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    return groups + ([group] if group else [])


class _Buffers:
    """The fixed device buffers of one run, made once and never reallocated (a CUDA graph
    replays their addresses): per-slot ``prompt_len``/``total_len`` (bound to the replay
    state), the token each row feeds next, the step's ``idx_mapping`` and ``sampled`` tokens,
    the step counter, the per-step outputs ``[n_steps, max_batch]`` and, when sampling, the
    uniform noise ``[max_batch, vocab_size]`` of a ``torch.Generator`` seeded with ``seed``."""

    def __init__(self, schedule, vocab_size: int, dev: torch.device, temperature: float, seed: int):
        rows, steps = schedule.max_batch, schedule.n_steps
        self.prompt_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # per slot, read by replay
        self.total_len = torch.zeros(rows, dtype=torch.int32, device=dev)  # prompt + tokens decoded so far
        self.last = torch.zeros(rows, dtype=torch.int64, device=dev)  # the token each row feeds next
        self.idx_all = torch.from_numpy(schedule.idx_mapping).to(dev)
        self.idx_mapping = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.sampled = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.step_t = torch.zeros(1, dtype=torch.int64, device=dev)  # the step the graph writes
        self.out = {
            name: torch.zeros(steps, rows, dtype=dt, device=dev)
            for name, dt in (
                ("tokens", torch.int64),
                ("argmax", torch.int64),
                ("logprobs", torch.float32),
                ("ranks", torch.int64),
            )
        }
        self.generator = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
        self.uniform = (
            torch.full((rows, vocab_size), 0.5, dtype=torch.float32, device=dev) if self.generator is not None else None
        )

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(active, positions)`` of the step: rows in use, and each one's cache position
        (empty rows: 0, anywhere in range)."""
        active = self.idx_mapping >= 0
        return active, torch.where(active, self.total_len.long() - 1, 0)

    def record(self, active: torch.Tensor, argmax: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor) -> None:
        """The step's tail: its outputs into row ``step_t``, active rows one token longer and
        fed their ``sampled`` token next, the counter advanced (all on the device)."""
        for name, value in (("tokens", self.sampled), ("argmax", argmax), ("logprobs", logprobs), ("ranks", ranks)):
            self.out[name].index_copy_(0, self.step_t, value[None])
        self.total_len.add_(active.to(torch.int32))
        self.last.copy_(torch.where(active, self.sampled, self.last))
        self.step_t.add_(1)


def _run_steps(
    model,
    cache: torch.Tensor,
    buf: _Buffers,
    schedule,
    prompts,
    traces,
    vocab_size: int,
    dev: torch.device,
    step: Callable[[TraceReplayState], None],
    use_graph: bool,
    on_step: Callable[[int], None] | None,
) -> dict[str, np.ndarray]:
    """Every step of ``schedule``: prefill and admit the step's requests (lengths, last tokens,
    traces), ``apply_staged_writes``, then ``step(state)`` on ``buf`` (captured once in a CUDA
    graph when ``use_graph``). Returns the outputs on the host, copied once at the end."""
    max_trace = max((len(t) for t in traces if t is not None), default=1)
    per_step = schedule.tokens_per_step.tolist()
    with TraceReplayState(
        schedule.max_batch,
        max_trace,
        device=dev,
        total_len=buf.total_len,
        prompt_len=buf.prompt_len,
        vocab_size=vocab_size,
    ) as state:
        graph = _capture(lambda: step(state), buf.step_t) if use_graph else None
        for k in range(schedule.n_steps):
            admitted = schedule.admitted(k).tolist()
            for group in _prefill_groups(admitted, prompts):
                n = max(len(prompts[i]) - 1 for i in group)
                block = np.zeros((len(group), n), dtype=np.int64)
                for j, i in enumerate(group):
                    block[j, : len(prompts[i]) - 1] = prompts[i][:-1]
                model.prefill(
                    cache,
                    _upload([schedule.slot[i] for i in group], torch.int64, dev),
                    _upload(block, torch.int64, dev),
                )
            if admitted:
                slots = _upload([schedule.slot[i] for i in admitted], torch.int64, dev)
                lens = _upload([len(prompts[i]) for i in admitted], torch.int32, dev)
                buf.prompt_len[slots] = lens
                buf.total_len[slots] = lens
                buf.last[slots] = _upload([prompts[i][-1] for i in admitted], torch.int64, dev)
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
            if on_step is not None:
                on_step(per_step[k])
        return {name: t.cpu().numpy() for name, t in buf.out.items()}


def _decode_all(
    config, weights, prompts, traces, schedule, dev, on_step, dtype, temperature, seed, use_graph
) -> dict[str, np.ndarray]:
    """Run every step of ``schedule``; return the per-step outputs ``[n_steps, max_batch]`` on the host."""
    c = config
    model = _Llama(c, weights, dev, dtype)
    rows = schedule.max_batch
    kv_len = schedule.kv_positions([len(p) for p in prompts])
    cache = torch.zeros(
        c.num_hidden_layers, 2, rows, c.num_key_value_heads, kv_len, c.head_dim, dtype=dtype, device=dev
    )
    buf = _Buffers(schedule, c.vocab_size, dev, temperature, seed)
    logprobs = torch.zeros(rows, dtype=torch.float32, device=dev)
    ranks = torch.zeros(rows, dtype=torch.int64, device=dev)
    argmax = torch.zeros(rows, dtype=torch.int64, device=dev)
    greedy = torch.zeros(rows, dtype=torch.bool, device=dev)  # rows that take their argmax

    def step(state: TraceReplayState) -> None:
        """One decode step of every row, on fixed buffers (no host sync, no allocation the
        graph cannot own). The logits are read once after the model for logprob, rank and
        argmax (greedy: every untraced row is -1 until then and is scored as its argmax)."""
        active, positions = buf.positions()
        logits = model.decode(cache, buf.last, positions)
        if buf.uniform is None:
            buf.sampled.fill_(-1)  # -1: greedy, the argmax below
        else:  # Gumbel-max over logits / temperature
            gumbel = -torch.log(-torch.log(buf.uniform.clamp_min(torch.finfo(torch.float32).tiny)))
            buf.sampled.copy_((logits.float() / temperature + gumbel).argmax(dim=-1))
        state.replay(buf.sampled, buf.idx_mapping)  # traced rows take their trace token
        # From the unmodified logits; argmax ties: the lowest id, as torch.argmax.
        token_logprob_rank(logits, buf.sampled, argmax=True, out=(logprobs, ranks, argmax))
        if buf.uniform is None:
            torch.lt(buf.sampled, 0, out=greedy)
            torch.where(greedy, argmax, buf.sampled, out=buf.sampled)
        buf.record(active, argmax, logprobs, ranks)

    return _run_steps(model, cache, buf, schedule, prompts, traces, c.vocab_size, dev, step, use_graph, on_step)


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
