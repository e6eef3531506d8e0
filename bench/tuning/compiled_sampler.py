"""Where does a compiled sampler's host time go? (a trial behind bench/launch.py)

Per batch (1, 256): host us per call (median of back-to-back calls, synchronised at the end of
each round) of a greedy sampler (argmax over ``[batch, 32000]`` bf16 logits) alone, with replay +
logprob + rank through the registered ops, and written the natural way (``state.replay``,
``token_logprob_rank``), eager and under ``torch.compile(fullgraph=True)``; how many binds
(validations over DLPack) happen after warm-up; the number of compilations; and a cProfile of
the compiled sampler with the ops, by own time. Then the parts: a compiled identity function
(Dynamo's guards and the compiled-code wrappers alone), each op called through the dispatcher
(``torch.ops.trace_replay.*.default``, what compiled code calls), and the direct calls behind
them (``state.replay``, the logprob function's no-gradient path).

Run: ``python bench/tuning/compiled_sampler.py`` on the GPU; prints what it finds.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import time

import torch

import trace_replay_core._table as core_table
import trace_replay_torch.logprob as torch_logprob
from trace_replay_torch import TraceReplayState, replay_op, token_logprob_rank, token_logprob_rank_op

VOCAB = 32_000
BINDS = {"replay": 0, "logprob": 0}


def _counting(name, fn):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        BINDS[name] += 1
        return fn(*a, **k)

    return wrapped


core_table.TraceTable._bind_cached = _counting("replay", core_table.TraceTable._bind_cached)  # type: ignore[method-assign]  # a trial counts binds
torch_logprob.bind_logprob_rank = _counting("logprob", torch_logprob.bind_logprob_rank)


def alone(state, logits, idx):
    return torch.argmax(logits, dim=-1)


def ops(state, logits, idx):
    sampled = torch.argmax(logits, dim=-1)
    replay_op(state, sampled, idx)
    logprobs, ranks = token_logprob_rank_op(logits, sampled)
    return sampled, logprobs, ranks


def natural(state, logits, idx):
    sampled = torch.argmax(logits, dim=-1)
    state.replay(sampled, idx)
    logprobs, ranks = token_logprob_rank(logits, sampled)
    return sampled, logprobs, ranks


def host_us(fn, calls=300, rounds=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    per.sort()
    return per[len(per) // 2], per[1], per[-2]


def main():
    dev = torch.device("cuda")
    for batch in (1, 256):
        total = torch.full((1024,), 7, dtype=torch.int32, device=dev)
        prompt = torch.full((1024,), 3, dtype=torch.int32, device=dev)
        st = TraceReplayState(max_slots=1024, max_trace_len=64, device=dev, total_len=total, prompt_len=prompt)
        for s in range(0, 1024, 2):
            st.add_request(s, list(range(5, 60)))
        st.apply_staged_writes()
        logits = torch.randn(batch, VOCAB, device=dev).bfloat16()
        idx = torch.arange(batch, dtype=torch.int32, device=dev)
        ref = natural(st, logits, idx)
        for name, fn in (("alone", alone), ("ops", ops), ("natural", natural)):
            for mode in ("eager", "compiled"):
                torch._dynamo.reset()
                f = fn if mode == "eager" else torch.compile(fn, fullgraph=True, dynamic=False)
                try:
                    out = f(st, logits, idx)
                except Exception as exc:  # noqa: BLE001 - a trial: report what failed
                    print(f"B={batch} {name} {mode}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                same = name == "alone" or all(torch.equal(a, b) for a, b in zip(ref, out))
                frames = dict(torch._dynamo.utils.counters["stats"])
                for k in BINDS:
                    BINDS[k] = 0
                med, lo, hi = host_us(functools.partial(f, st, logits, idx))
                print(
                    f"B={batch} {name:8s} {mode:8s} host {med:7.1f} us [{lo:.1f}, {hi:.1f}]  binds after warm-up "
                    f"{dict(BINDS)}  same as eager: {same}  dynamo {frames}",
                    flush=True,
                )
                if name == "ops" and mode == "compiled" and batch == 256:
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(300):
                        f(st, logits, idx)
                    torch.cuda.synchronize()
                    pr.disable()
                    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        parts(st, logits, idx)
        st.close()


def parts(st, logits, idx):
    """Host us of the pieces a compiled sampler's step is made of."""
    from trace_replay_torch.logprob import compute_logprob_rank

    sampled = torch.argmax(logits, dim=-1)
    total, prompt = st._bound_lengths()
    ops = torch.ops.trace_replay
    torch._dynamo.reset()
    ident = torch.compile(lambda state, x, i: x, fullgraph=True, dynamic=False)
    rows = {
        "compiled identity (guards + wrappers)": lambda: ident(st, logits, idx),
        "replay op via dispatcher": lambda: ops.replay.default(sampled, idx, total, prompt, st.op_id),
        "state.replay direct": lambda: st.replay(sampled, idx),
        "logprob op via dispatcher": lambda: ops.token_logprob_rank.default(logits, sampled, None),
        "logprob direct (no-gradient path)": lambda: compute_logprob_rank(logits, sampled),
    }
    for name, fn in rows.items():
        med, lo, hi = host_us(fn)
        print(f"B={logits.shape[0]} part {name:40s} host {med:7.1f} us [{lo:.1f}, {hi:.1f}]", flush=True)
    with torch.inference_mode():  # the autograd keys excluded: what the dispatcher costs without them
        med, lo, hi = host_us(rows["logprob op via dispatcher"])
    print(f"B={logits.shape[0]} part {'logprob op via dispatcher, inference_mode':40s} host {med:7.1f} us "
          f"[{lo:.1f}, {hi:.1f}]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
