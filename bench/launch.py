"""Host time per replay step: this library's torch path vs other ways to launch the same work.

Question: what does one replay step cost the decode loop's host thread, at batch 1, 256, 1024?
Setup: 1024 slots, 8192 tokens per slot, every slot traced, steps spread before/inside/past the
traces. Each provider runs 2000 back-to-back calls per round, 15 rounds, no synchronisation
inside a round (so a GPU-bound provider shows GPU time); reported p20/p50/p80 over rounds.

Providers:
- ``trace_replay_torch``: ``TraceReplayState.replay(sampled, idx_mapping)`` (lengths bound),
  for both table placements.
- ``core_bound``: a :class:`trace_replay_core.BoundReplay` called directly (no adapter): one
  ``cuLaunchKernel`` through cuda-bindings with a parameter block packed at bind time.
- ``core_bound_triton_launcher``: the same bound launch through the compiled kernel's Triton
  launcher (the path ``commit`` and unbound launches take).
- ``core_dlpack_every_call``: ``TraceTable.replay`` with torch tensors, re-reading all four
  arrays over DLPack every call (what a cache-less adapter would pay).
- ``triton_jit_launcher``: the same kernel source as a plain ``@triton.jit`` function launched
  as ``kernel[grid](torch tensors)`` (the reference implementation's launch style, with
  Triton's default argument specialisation).
- ``triton_jit_launcher_hinted``: the library's kernel object (no specialisation of sizes or
  alignment) through the same JIT launcher: how much of the gap the hints alone close.
- ``torch_native``: gather + where in torch ops (several kernels).
- ``cuda_graph``: a CUDA graph holding one replay launch, replayed (the floor).
- ``torch_ops_eager``: the registered op ``torch.ops.trace_replay.replay.default`` called eagerly (what
  an op costs through torch's dispatcher, next to ``trace_replay_torch``'s direct path).

A second question: what does a whole sampler step cost (greedy ``argmax`` over ``[batch,
32000]`` bf16 logits, replay, logprob and rank of the result), eager against compiled?

- ``sampler_eager``: ``argmax`` + ``TraceReplayState.replay`` + ``token_logprob_rank``.
- ``sampler_compiled``: the same through the registered ops, ``torch.compile(fullgraph=True)``.
- ``sampler_compiled_cudagraph``: the same with ``mode="reduce-overhead"`` (CUDA graph replays,
  ``cudagraph_mark_step_begin`` each step as a loop would call it).
- ``sampler_natural_compiled``: the eager sampler's code (the state's own methods) under
  ``torch.compile(fullgraph=True)``.
- ``argmax_alone_eager`` / ``argmax_alone_compiled`` / ``argmax_alone_compiled_cudagraph``: the
  same samplers without replay, logprob and rank (``argmax`` only): what the targets compare with.

At large batches the sampler reads the logits twice and shows device time.

Does not measure: device time of the kernel (see ``bench/`` scaling scripts), commits.
Run: ``python bench/launch.py [--batches 1,256]`` on a GPU; writes ``bench/results/launch.json``
(the batches given).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_args, provenance, table, time_host, write_results  # noqa: E402

MAX_SLOTS = 1024
MAX_TRACE_LEN = 8192
BATCHES = (1, 256, 1024)
VOCAB = 32_000


def _samplers():
    """The eager sampler and its registered-op twin (the function that ``torch.compile`` gets)."""
    import torch

    from trace_replay_torch import replay_op, token_logprob_rank, token_logprob_rank_op

    def eager(state, logits, idx_mapping):
        sampled = torch.argmax(logits, dim=-1)
        state.replay(sampled, idx_mapping)
        logprobs, ranks = token_logprob_rank(logits, sampled)
        return sampled, logprobs, ranks

    def through_ops(state, logits, idx_mapping):
        sampled = torch.argmax(logits, dim=-1)
        replay_op(state, sampled, idx_mapping)
        logprobs, ranks = token_logprob_rank_op(logits, sampled)
        return sampled, logprobs, ranks

    def alone(state, logits, idx_mapping):
        return torch.argmax(logits, dim=-1)

    return eager, through_ops, alone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--batches",
        type=lambda s: tuple(int(b) for b in s.split(",")),
        default=BATCHES,
        help="comma-separated batch sizes (default: 1,256,1024; the whole run takes about 10 minutes on an H200)",
    )
    batches = parse_args(__doc__, parser).batches
    import torch
    import triton

    from trace_replay_core.kernels.replay import REPLAY_BLOCK, plan_replay, replay_compiled, replay_kernel
    from trace_replay_torch import TraceReplayState

    plain_kernel = triton.jit(replay_kernel.fn)  # same source, Triton's default specialisation
    dev = torch.device("cuda", 0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, MAX_TRACE_LEN + 1, MAX_SLOTS)
    traces = [rng.integers(0, 150_000, n) for n in lengths]
    prompt = rng.integers(1, 2000, MAX_SLOTS)
    total = prompt + rng.integers(-2, MAX_TRACE_LEN + 2, MAX_SLOTS)
    total_len = torch.tensor(total, dtype=torch.int32, device=dev)
    prompt_len = torch.tensor(prompt, dtype=torch.int32, device=dev)
    sync = torch.cuda.synchronize
    rows = []

    def record(provider, batch, placement, stats):
        rows.append(dict(provider=provider, batch=batch, placement=placement, **stats))
        print(
            f"{provider:26s} B={batch:5d} {placement:12s} p50 {stats['us_p50']:8.2f} us "
            f"(p20 {stats['us_p20']:.2f}, p80 {stats['us_p80']:.2f})",
            flush=True,
        )

    states = {}
    for placement in ("device", "host_mapped"):
        st = TraceReplayState(
            MAX_SLOTS, MAX_TRACE_LEN, device=dev, total_len=total_len, prompt_len=prompt_len, placement=placement
        )
        for slot, tr in enumerate(traces):
            st.add_request(slot, tr)
        st.apply_staged_writes()
        states[placement] = st
    sync()
    table_np, len_np = states["device"].table.snapshot()
    table_t = torch.from_numpy(table_np).to(dev)
    len_t = torch.from_numpy(len_np).to(dev)

    for batch in batches:
        idx = torch.tensor(rng.permutation(MAX_SLOTS)[:batch], dtype=torch.int32, device=dev)
        base = torch.tensor(rng.integers(0, 150_000, batch), dtype=torch.int64, device=dev)
        outs = {}
        for placement, st in states.items():
            sampled = base.clone()
            replay = functools.partial(st.replay, sampled, idx)
            record("trace_replay_torch", batch, placement, time_host(replay, sync=sync))
            outs[placement] = sampled
        st = states["device"]
        stream = torch.cuda.current_stream().cuda_stream
        sampled = base.clone()
        bound = st.table.bind_replay(sampled, idx, total_len, prompt_len, stream=stream)
        record("core_bound", batch, "device", time_host(functools.partial(bound, stream=stream), sync=sync))
        sampled = base.clone()
        kernel = replay_compiled(0, "int64", "int32", ("int32", "int32"), None)
        table_view, lengths_view = st.table.device_views()
        via_triton = kernel.bind(
            plan_replay(batch),
            sampled.data_ptr(),
            idx.data_ptr(),
            total_len.data_ptr(),
            prompt_len.data_ptr(),
            0,
            table_view.ptr,
            lengths_view.ptr,
            batch,
            MAX_SLOTS,
            MAX_TRACE_LEN,
            driver=False,
        )
        stats = time_host(functools.partial(via_triton, stream), sync=sync)
        record("core_bound_triton_launcher", batch, "device", stats)
        outs["triton_launcher"] = sampled
        sampled = base.clone()
        record(
            "core_dlpack_every_call",
            batch,
            "device",
            time_host(
                functools.partial(st.table.replay, sampled, idx, total_len, prompt_len, stream=stream),
                sync=sync,
                calls=300,
                rounds=7,
                warmup=20,
            ),
        )

        grid = (triton.cdiv(batch, REPLAY_BLOCK),)
        for name, kernel in (("triton_jit_launcher", plain_kernel), ("triton_jit_launcher_hinted", replay_kernel)):
            sampled = base.clone()
            jit_launch = functools.partial(
                kernel[grid],
                sampled,
                idx,
                total_len,
                prompt_len,
                total_len,
                table_t,
                len_t,
                batch,
                MAX_SLOTS,
                MAX_TRACE_LEN,
                PER_ROW_STEP=False,
                BLOCK=REPLAY_BLOCK,
                num_warps=4,
            )
            record(name, batch, "device", time_host(jit_launch, sync=sync))
            outs[name] = sampled

        sampled = base.clone()

        def native(sampled=sampled, idx=idx):
            slot = idx.long()
            valid = slot >= 0
            s = slot.clamp(min=0)
            n = len_t[s]
            step = (total_len[s] - prompt_len[s]).long()
            valid = valid & (n > 0) & (step >= 0) & (step < n)
            tok = table_t[s, step.clamp(0, MAX_TRACE_LEN - 1)]
            sampled.copy_(torch.where(valid, tok.to(sampled.dtype), sampled))

        record("torch_native", batch, "device", time_host(native, sync=sync))
        outs["native"] = sampled

        sampled = base.clone()
        st.replay(sampled, idx)  # warm (compiled, bound) before capture
        sync()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph):
                st.replay(sampled, idx)
        torch.cuda.current_stream().wait_stream(side)
        record("cuda_graph", batch, "device", time_host(graph.replay, sync=sync))
        outs["graph"] = sampled

        sampled = base.clone()
        op_id = st.op_id
        replay_through_op = torch.ops.trace_replay.replay.default  # the overload compiled code calls
        record(
            "torch_ops_eager",
            batch,
            "device",
            time_host(functools.partial(replay_through_op, sampled, idx, total_len, prompt_len, op_id), sync=sync),
        )
        outs["torch_ops"] = sampled
        sync()
        ref = outs["device"].cpu()
        same = all(torch.equal(ref, o.cpu()) for o in outs.values())
        print(f"B={batch}: all providers produced identical tokens: {same}", flush=True)

        logits = torch.randn(batch, VOCAB, device=dev).to(torch.bfloat16)
        eager, through_ops, alone = _samplers()
        results = {"sampler_eager": eager(st, logits, idx)}
        record("sampler_eager", batch, "device", time_host(functools.partial(eager, st, logits, idx), sync=sync))
        record("argmax_alone_eager", batch, "device", time_host(functools.partial(alone, st, logits, idx), sync=sync))
        for name, fn in (("sampler_compiled", through_ops), ("sampler_natural_compiled", eager),
                         ("argmax_alone_compiled", alone)):  # fmt: skip
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            if fn is not alone:
                results[name] = compiled(st, logits, idx)
            record(name, batch, "device", time_host(functools.partial(compiled, st, logits, idx), sync=sync))
        for name, fn in (("sampler_compiled_cudagraph", through_ops), ("argmax_alone_compiled_cudagraph", alone)):
            graphed = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

            def graphed_step(graphed=graphed, st=st, logits=logits, idx=idx):
                torch.compiler.cudagraph_mark_step_begin()
                return graphed(st, logits, idx)

            for _ in range(3):  # warm-up, record, first replay
                graphed_step()
            if fn is not alone:
                results[name] = [t.clone() for t in graphed_step()]
            record(name, batch, "device", time_host(graphed_step, sync=sync))
        sync()

        # NaN == NaN here: traced rows whose trace ids lie above this sampler's vocabulary get
        # logprob NaN (and rank -1) by contract, in every sampler alike.
        def equal(a, b):
            return (
                torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            )

        same = all(all(equal(a, b) for a, b in zip(results["sampler_eager"], r)) for r in results.values())
        print(f"B={batch}: compiled samplers equal the eager one (tokens, logprobs, ranks): {same}", flush=True)
        if not same:  # which outputs part, and whether rows whose maximum is tied explain it
            top2 = logits.float().topk(2, dim=-1).values
            tied = (top2[:, 0] == top2[:, 1]).cpu()
            ref = results["sampler_eager"]
            for name, r in results.items():
                parts = [int((~((a == b) | (a != a) & (b != b))).sum()) for a, b in zip(ref, r)]
                differing = (ref[0] != r[0]).cpu()
                print(
                    f"  {name}: rows differing in tokens/logprobs/ranks {parts}; token rows differing with a "
                    f"tied maximum {int((differing & tied).sum())} of {int(differing.sum())} (rows with a "
                    f"tie: {int(tied.sum())})",
                    flush=True,
                )

    for st in states.values():
        st.close()
    path = write_results("launch", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    print(table(rows, ["provider", "batch", "placement", "us_p50", "us_p20", "us_p80"]))


if __name__ == "__main__":
    main()
