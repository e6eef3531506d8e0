"""Real-model decode speed: the Llama-family loops (torch, JAX) next to transformers' ``generate``.

Question: replaying traced requests through a Qwen2.5-0.5B-shaped model in bf16 on one GPU,
how many tokens per second and milliseconds per decode step do the torch loop (CUDA-graph
step) and the JAX loop (one jitted step) reach, next to transformers' ``generate`` on the same
model, batch and lengths; how far is each from the step's memory-bound floor; and what share
of a step do replay and logprob/rank take?

Setup: a ``qwen2`` model of hidden 896, 24 layers, 14 heads, 2 key/value heads, intermediate
4864, vocabulary 151,936, tied embeddings, random weights made by transformers on the GPU
(``AutoModelForCausalLM.from_config``, bf16); our loops get the same weights (bf16 widened to
float32 exactly, cast back to bf16 on load). Per batch ``B`` (64 and 256): ``B`` requests
(seed 0), prompts of 64-512 tokens, traces of 128-512 random tokens, all decoding at once
(``max_batch=B``); ``generate`` gets the same prompts (left-padded) and decodes
``max(trace lengths)`` tokens greedily for every row (it has no per-row lengths).

Method: per provider and batch, one warm-up call (compilation, graph capture, allocator),
then timed calls of the whole decode (prefill included) and with traces of one token
(``generate``: ``max_new_tokens=1``): the prefill and every fixed cost of a call (our loops also
upload the weights and, in torch, capture the graph, in every call); our loops alternate the two
``REPEATS`` times and the medians count, ``generate`` is timed once each.
``decode_ms_per_step`` = (whole - prefill) / (steps - 1); ``tokens_per_s`` = ``B`` /
``decode_ms_per_step`` (every row decodes one token per step: how the issue quotes
``generate``); ``call_tokens_per_s`` = the traces' tokens / the whole call, fixed costs and
prefill included (``generate`` decodes ``B * steps`` tokens for them). ``floor_ms`` = bytes one step must
read (every weight once, bf16, plus the mean KV cache filled over the steps) / the
device-to-device copy bandwidth measured in this run. ``replay_logprob_us``: what replay and
logprob/rank add to a greedy step over ``[B, 151,936]`` bf16 logits: the loops' fused pass
(replay into ids of -1, then one ``token_logprob_rank(..., argmax=True)`` that also yields the
greedy tokens) minus an argmax pass alone (torch: CUDA events over queued calls; JAX: 32 steps
in one ``lax.fori_loop``), and its share of the decode step; ``replay_logprob_parts_us`` has the
three times, and ``replay_logprob_separate_share`` the share of the former step (argmax pass,
replay, separate logprob pass).

Run: ``python bench/models.py`` on the GPU (about 3 minutes on an H200); writes
``bench/results/models.json`` and prints a table last. ``--quick``: a CPU dry run with a tiny
model and small batches (writes nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import copy_bandwidth, table, write_results  # noqa: E402
from models_sampler import replay_logprob_us  # noqa: E402
from qwen_shape import FULL, QUICK, hf_model, prefill_only, traced_requests  # noqa: E402

REPEATS = 2  # timed whole / prefill-only calls of our loops (medians)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _our_loop(framework, config, weights, device):
    from trace_replay_app.models.llama import load_loop

    run = load_loop(framework)

    def call(requests):
        results = run(config, weights, requests, device=device, max_batch=len(requests), dtype="bfloat16")
        return results  # results are host arrays: the call has waited for the device

    return call


def _generate(model, device):
    import torch

    def call(requests, new_tokens):
        longest = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), longest, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding, as decoder-only generation wants
            ids[i, longest - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, longest - len(r.prompt) :] = 1
        with torch.no_grad():
            return model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    return call


def _floor_bytes(config, requests, weight_bytes):
    """Bytes one decode step must read, averaged over the steps: every weight once plus the
    KV cache the active rows hold (bf16)."""
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    steps = max(len(r.trace) for r in requests)
    kv = 0
    for r in requests:
        n = len(r.trace)
        kv += per_token * (n * len(r.prompt) + n * (n - 1) / 2)  # positions held at steps 0 .. n-1
    return weight_bytes + kv / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a CPU dry run with a tiny model (writes nothing)")
    ap.add_argument("--frameworks", default="torch,jax,transformers")
    args = ap.parse_args()
    setup = QUICK if args.quick else FULL
    device = "cpu" if args.quick else "cuda"
    providers = args.frameworks.split(",")

    from trace_replay_app.models.llama.hf import config_from_hf, weights_from_tensors

    t0 = time.perf_counter()
    model, hf_config = hf_model(setup["sizes"], device)
    config = config_from_hf(hf_config.to_dict())
    weights = weights_from_tensors(
        config,
        {
            k: v.float().cpu().numpy()
            for k, v in model.state_dict().items()
            if not (config.tie_word_embeddings and k == "lm_head.weight")
        },
    )
    weight_bytes = 2 * sum(int(np.prod(w.shape)) for w in weights.values())
    print(f"model ready in {time.perf_counter() - t0:.1f} s: {weight_bytes / 1e9:.2f} GB of bf16 weights")
    bandwidth = copy_bandwidth()["d2d"]["gbps_p50"] if device == "cuda" else float("nan")

    rows = []
    for batch in setup["batches"]:
        rng = np.random.default_rng(0)
        requests = traced_requests(rng, batch, setup["prompt"], setup["trace"], config.vocab_size)
        prefill_requests = prefill_only(requests)
        steps = max(len(r.trace) for r in requests)
        useful = sum(len(r.trace) for r in requests)
        floor_bytes = _floor_bytes(config, requests, weight_bytes)
        floor_ms = floor_bytes / (bandwidth * 1e9) * 1e3
        for provider in providers:
            t_start = time.perf_counter()
            if provider == "transformers":
                call = _generate(model, device)
                call(requests, 8)  # warm-up
                whole, _ = _timed(lambda call=call, requests=requests, steps=steps: call(requests, steps), device)
                prefill, _ = _timed(lambda call=call, requests=requests: call(requests, 1), device)
                exact, replay_us, replay = None, None, {}
                wholes, prefills = [whole], [prefill]
            else:
                call = _our_loop(provider, config, weights, device)
                call(requests)  # warm-up: compile, capture
                call(prefill_requests)  # its own warm-up (JAX: another program)
                # Each of our calls carries ~0.3-3.5 s of fixed cost (weights uploaded, JAX's
                # program set up) that moved by 0.3 s between single calls on 2026-12-02, as much
                # as the decode itself: the whole and the prefill-only calls alternate REPEATS
                # times, and their medians are subtracted.
                wholes, prefills = [], []
                for _ in range(REPEATS):
                    whole, results = _timed(lambda call=call, requests=requests: call(requests), device)
                    wholes.append(whole)
                    prefills.append(_timed(lambda call=call, p=prefill_requests: call(p), device)[0])
                whole, prefill = float(np.median(wholes)), float(np.median(prefills))
                exact = all(res.tokens.tolist() == list(r.trace) for r, res in zip(requests, results))
                replay = replay_logprob_us(provider, batch, config.vocab_size, device)
                replay_us = replay.get("added", float("nan"))
            step_ms = (whole - prefill) / max(1, steps - 1) * 1e3
            row = {
                "provider": provider,
                "batch": batch,
                "steps": steps,
                "useful_tokens": useful,
                "whole_s": whole,
                "prefill_s": prefill,
                "whole_runs_s": wholes,
                "prefill_runs_s": prefills,
                "tokens_per_s": batch / step_ms * 1e3,
                "call_tokens_per_s": useful / whole,
                "decode_ms_per_step": step_ms,
                "floor_ms": floor_ms,
                "floor_bytes": floor_bytes,
                "d2d_gbps": bandwidth,
                "x_floor": step_ms / floor_ms if floor_ms == floor_ms else None,
                "replay_logprob_us": replay_us,
                "replay_logprob_share": None if replay_us is None else replay_us / (step_ms * 1e3),
                "replay_logprob_parts_us": replay,
                "replay_logprob_separate_share": (
                    replay["added_separate"] / (step_ms * 1e3) if "added_separate" in replay else None
                ),
                "traces_reproduced": exact,
                "bench_s": time.perf_counter() - t_start,
            }
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

    for row in rows:  # speed-ups against generate at the same batch
        ref = [r for r in rows if r["provider"] == "transformers" and r["batch"] == row["batch"]]
        row["x_generate_tokens_per_s"] = row["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else None
    shape = {
        "model": "qwen2 " + json.dumps(setup["sizes"]),
        "dtype": "bfloat16",
        "prompt_tokens": list(setup["prompt"]),
        "trace_tokens": list(setup["trace"]),
    }
    if args.quick:
        json.dumps(rows)  # the rows serialise; a dry run writes nothing
        print("quick run: nothing written")
    else:
        print("wrote", write_results("models", [dict(r, **shape) for r in rows]))
    print(
        table(
            rows,
            [
                "provider",
                "batch",
                "tokens_per_s",
                "call_tokens_per_s",
                "decode_ms_per_step",
                "floor_ms",
                "x_floor",
                "x_generate_tokens_per_s",
                "replay_logprob_us",
                "replay_logprob_share",
                "replay_logprob_separate_share",
                "traces_reproduced",
            ],
        )
    )


if __name__ == "__main__":
    main()
