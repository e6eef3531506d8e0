"""Teacher-forced scoring speed and memory: ``run_score`` (torch, JAX) next to transformers' forward.

Question: scoring the completions of a batch the way a trainer does (one forward over prompt +
completion), how long does a batch take in each framework, how much device memory does it
peak at, and what share is the logprob op? The peer is what a user writes with transformers:
``model(input_ids).logits`` (sdpa attention, bf16), ``log_softmax`` in float32 over every
position and a gather of the completion tokens (the whole ``[batch, tokens, vocab]`` logits and
their float32 log-softmax exist at once).

Setup: the Qwen2.5-0.5B shape of ``qwen_shape.py`` (random weights made by transformers on the
GPU, bf16; our drivers get the same weights), batches of ``B`` x 1,024 tokens (``B`` = 16 and
64): a 1-token prompt and 1,023 completion tokens per row, random ids (seed 0). Our drivers
score every completion token (the output projection and the logprob op run ``CHUNK_ROWS``
positions at a time: ``--chunk-rows``). ``floor_ms``: the matrix products of the forward
(2 x parameters x tokens, the tied output projection counted once) at the bf16 matmul rate
measured in this run (8192^3).

Method: per provider one warm-up call (compilation, allocator), then ``REPEATS`` timed calls
(host wall time around a synchronised call; weights already on the device); the median counts.
Peak memory: torch ``max_memory_allocated`` after a reset, JAX ``peak_bytes_in_use`` of the
device (JAX never resets it: its figure covers the warm-up too). ``logprob_share``: the logprob
op's device time over the call's scored rows (CUDA events, one chunk of bf16 logits timed and
scaled) over the torch call's median.

Run: ``python bench/score.py`` on the GPU (about 2 minutes on an H200); writes
``bench/results/score.json`` and prints a table. ``--quick``: a CPU dry run with a tiny model.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import table, time_cuda, write_results  # noqa: E402
from qwen_shape import FULL, QUICK, hf_model  # noqa: E402

REPEATS = 5
PEER = "transformers forward + log_softmax(float32) + gather (sdpa, bf16)"
CHUNK_ROWS = 4096


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peer(model, seqs):
    """What a user writes with transformers: the forward, a float32 log-softmax, a gather."""
    import torch

    with torch.inference_mode():
        logp = model(seqs).logits.float().log_softmax(-1)
        return logp[:, :-1].gather(-1, seqs[:, 1:, None])[..., 0]


def _median_ms(fn, device: str, repeats: int) -> tuple[float, list[float], Any]:
    out = fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times)), times, out


def _requests(batch: int, tokens: int, vocab: int):
    from trace_replay_app.records import TraceRequest

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, tokens))
    return [TraceRequest(f"r{i}", (int(row[0]),), tuple(int(t) for t in row[1:])) for i, row in enumerate(ids)]


def _matmul_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_cuda(lambda: a @ a)["us_p50"]
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a CPU dry run with a tiny model (writes nothing)")
    ap.add_argument("--frameworks", default="torch,torch-compile,jax,transformers")
    ap.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    args = ap.parse_args()
    setup = QUICK if args.quick else FULL
    device = "cpu" if args.quick else "cuda"
    batches, tokens = ((2, 4), 32) if args.quick else ((16, 64), 1024)
    import torch

    from trace_replay_app.drivers import jax_score, torch_score
    from trace_replay_app.models.llama import jax_loop, torch_loop
    from trace_replay_app.models.llama.hf import config_from_hf, weights_from_tensors
    from trace_replay_app.scoring import plan_score
    from trace_replay_torch import token_logprob_rank

    model, hf_config = hf_model(setup["sizes"], device)
    config = config_from_hf(hf_config.to_dict())
    state = model.state_dict()
    weights = weights_from_tensors(
        config,
        {
            k: v.float().cpu().numpy()
            for k, v in state.items()
            if not (config.tie_word_embeddings and k == "lm_head.weight")
        },
    )
    params_count = sum(int(np.prod(w.shape)) for w in weights.values())
    tflops = _matmul_tflops(device)
    dev = torch.device(device)
    ours_torch = torch_loop.TORCH.build(config, weights, dev, torch.bfloat16, None)
    compiled = torch_score.Compiled(ours_torch)
    jdev = jparams = None
    if "jax" in args.frameworks:
        from trace_replay_jax import resolve_device

        jdev = resolve_device(device)
        jparams = jax_loop.JAX.model(config, weights, device=device, dtype="bfloat16")[1]
    rows: list[dict[str, Any]] = []
    for batch in batches:
        requests = _requests(batch, tokens, config.vocab_size)
        plan = plan_score(config, weights, requests, device=device, dtype="bfloat16", max_tokens=batch * tokens,
                          chunk_rows=args.chunk_rows, config_type=type(config),
                          check_weights=torch_loop.TORCH.check_weights)  # fmt: skip
        scored = sum(len(r.trace or ()) for r in requests)
        floor = 2 * params_count * batch * tokens / (tflops * 1e12) * 1e3 if tflops else None
        lp_ms = None
        if device == "cuda":
            x = torch.randn(args.chunk_rows, config.vocab_size, device="cuda").bfloat16()
            t = torch.randint(0, config.vocab_size, (args.chunk_rows,), device="cuda")
            lp_ms = time_cuda(functools.partial(token_logprob_rank, x, t, argmax=True))["us_p50"] / 1e3
            lp_ms *= scored / args.chunk_rows
            del x
        seqs = torch.tensor(np.stack([(*r.prompt, *(r.trace or ())) for r in requests]), device=device)
        calls = {
            "torch": functools.partial(torch_score.score_batches, ours_torch, plan, dev),
            "torch-compile": functools.partial(torch_score.score_batches, compiled, plan, dev),
            "jax": functools.partial(jax_score.score_batches, jax_loop.JAX, config, jparams, plan, jdev),
            "transformers": functools.partial(_peer, model, seqs),
        }
        firsts: dict[str, np.ndarray] = {}
        for provider in args.frameworks.split(","):
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            ms, times, out = _median_ms(calls[provider], device, 1 if args.quick else REPEATS)
            first_s = time.perf_counter() - t0 - sum(times) / 1e3  # the warm-up call: compilation included
            peak = None
            if device == "cuda" and provider not in ("jax",):
                peak = torch.cuda.max_memory_allocated() / 2**30
            elif device == "cuda" and jdev is not None:
                peak = jdev.memory_stats()["peak_bytes_in_use"] / 2**30
            firsts[provider] = (
                np.concatenate([o[0] for o in out])
                if provider != "transformers"
                else (out.float().cpu().numpy().ravel())
            )
            row = dict(provider=PEER if provider == "transformers" else provider, batch=batch, tokens_per_row=tokens,
                       scored_tokens=scored, ms=ms, ms_all=times, first_call_s=first_s,
                       tokens_per_s=batch * tokens / ms * 1e3,
                       peak_gib=peak, floor_ms=floor, logprob_op_ms=lp_ms,
                       logprob_share=(lp_ms / ms if lp_ms and provider == "torch" else None))  # fmt: skip
            rows.append(row)
            print(f"B={batch} {provider}: {ms:.1f} ms, peak {peak} GiB", flush=True)
        for name, got in firsts.items():  # every provider scores the same tokens (bf16: close, not equal)
            if name != "torch" and "torch" in firsts:
                print(f"B={batch} torch vs {name}: max |logprob diff| {np.abs(firsts['torch'] - got).max():.3g}")
    if not args.quick:
        print(write_results("score", rows))
    cols = ["provider", "batch", "ms", "tokens_per_s", "peak_gib", "floor_ms", "logprob_share"]
    print(table([{k: r[k] for k in cols} for r in rows], cols))


if __name__ == "__main__":
    main()
