"""The logprob op's backward: how close does it come to the read + write floor of the logits?

Question: the time of ``d L / d logits`` for ``L`` a weighted sum of ``token_logprob_rank``'s
logprobs (an RL loss), at vocab 151,936, batch 256 and 4096, bfloat16 and float32 logits, against
the floor ``(bytes of the logits read + bytes of the gradient written) / copy ceiling`` (the
ceiling: ``harness.copy_bandwidth()["d2d"]``, bytes read + written per second) and against torch's
``log_softmax`` + ``gather`` autograd (backward only: the forward runs once, outside the timing,
and its graph is kept). Target (issue 39): the kernel within 1.25x of the floor.

Providers:

- ``kernel``: the core's backward kernel alone, bound on integers and launched on the stream
  (``kernels.logprob_backward.bind_logprob_backward_launch``): the gradient of the logprobs;
- ``kernel_temperature``: the same with a per-row temperature and its gradient (the second,
  combine kernel);
- ``kernel_entropy``: the gradient of the logprobs and of the entropy;
- ``trace_replay_torch``: ``torch.autograd.grad`` through ``trace_replay_torch.token_logprob_rank``
  (the backward custom op: allocation, DLPack, the kernel);
- ``torch_fp32``: ``torch.log_softmax(logits.float(), -1).gather(...)`` autograd (the usual way:
  upcast, then the gradient cast back to the logits' dtype);
- ``torch_native``: ``torch.log_softmax(logits, -1).gather(...)`` in the logits' dtype.

Timing: ``cuda events (do_bench, L2 flushed)`` (``harness.time_cuda``), p20/p50/p80 in us; the
row's ``x_floor`` is p50 / floor. ``--quick`` runs batch 256 in bfloat16 with short repetitions
(seconds) and writes ``bench/results/logprob_backward_quick.json``; the full run writes
``bench/results/logprob_backward.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import copy_bandwidth, table, time_cuda, write_results  # noqa: E402

VOCAB = 151936
TARGET = 1.25


def _kernel_launch(logits, ids, lp, g, temp=None, grad_t=None, ent=None, g_ent=None):
    """A bound launch of the core's backward on these tensors, and the gradient it writes."""
    import torch

    from trace_replay_core import logprob_backward_workspace_bytes
    from trace_replay_core.kernels.logprob_backward import (
        LogprobBackwardArgs,
        LogprobBackwardDtypes,
        bind_logprob_backward_launch,
    )

    batch, vocab = logits.shape
    grad = torch.empty_like(logits)
    ws = torch.empty(
        max(16, logprob_backward_workspace_bytes(batch, vocab, grad_t is not None)),
        dtype=torch.uint8,
        device=logits.device,
    )

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    args = LogprobBackwardArgs(
        logits.data_ptr(), ids.data_ptr(), 0, ptr(temp), lp.data_ptr(), g.data_ptr(), 0, 0, 0, ptr(ent), ptr(g_ent),
        grad.data_ptr(), ptr(grad_t), ws.data_ptr(), batch, vocab, vocab, vocab, 0,
    )  # fmt: skip
    dtypes = LogprobBackwardDtypes(str(logits.dtype).removeprefix("torch."), "int64")
    launch = bind_logprob_backward_launch(args, dtypes, logits.device.index)
    stream = torch.cuda.current_stream().cuda_stream
    keep = (grad, ws)

    def run():
        launch(stream)

    run.keep = keep
    return run


def _providers(logits, ids, temp, g, g_ent):
    """name -> a callable that runs one backward (forward done, outside)."""
    import torch

    from trace_replay_torch import token_logprob_rank

    batch = logits.shape[0]
    fwd = token_logprob_rank(logits, ids, temperature=temp, entropy=True)
    fwd_plain = token_logprob_rank(logits, ids, entropy=True)
    grad_t = torch.empty(batch, device=logits.device)
    out = {
        "kernel": _kernel_launch(logits, ids, fwd_plain.logprobs, g),
        "kernel_temperature": _kernel_launch(logits, ids, fwd.logprobs, g, temp=temp, grad_t=grad_t),
        "kernel_entropy": _kernel_launch(logits, ids, fwd_plain.logprobs, g, ent=fwd_plain.entropy, g_ent=g_ent),
    }
    x = logits.detach().requires_grad_(True)
    ours = token_logprob_rank(x, ids).logprobs
    out["trace_replay_torch"] = lambda: torch.autograd.grad(ours, x, g, retain_graph=True)
    for name, cast in (("torch_fp32", True), ("torch_native", False)):
        y = logits.detach().requires_grad_(True)
        lp = torch.log_softmax(y.float() if cast else y, -1).gather(1, ids[:, None])[:, 0]
        out[name] = lambda lp=lp, y=y: torch.autograd.grad(lp, y, g.to(lp.dtype), retain_graph=True)
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 256 in bfloat16, short repetitions (seconds)")
    quick = parser.parse_args().quick
    batches, dtypes = ((256,), ("bfloat16",)) if quick else ((256, 4096), ("bfloat16", "float32"))
    reps = dict(warmup_ms=10, rep_ms=40) if quick else dict(warmup_ms=50, rep_ms=300)
    copy = copy_bandwidth(64 << 20 if quick else 256 << 20)["d2d"]
    ceiling = copy["gbps_p50"]
    torch.manual_seed(0)
    rows = []
    for dtype in dtypes:
        for batch in batches:
            logits = (torch.randn(batch, VOCAB, device="cuda") * 3).to(getattr(torch, dtype))
            ids = torch.randint(0, VOCAB, (batch,), device="cuda")
            temp = torch.rand(batch, device="cuda") + 0.5
            g, g_ent = torch.randn(batch, device="cuda"), torch.randn(batch, device="cuda")
            nbytes = 2 * logits.numel() * logits.element_size()  # the logits read, the gradient written
            floor_us = nbytes / ceiling / 1e3
            for name, fn in _providers(logits, ids, temp, g, g_ent).items():
                stats = time_cuda(fn, **reps)
                rows.append(
                    dict(
                        provider=name,
                        dtype=dtype,
                        batch=batch,
                        vocab=VOCAB,
                        **stats,
                        floor_us=floor_us,
                        x_floor=stats["us_p50"] / floor_us,
                        target_x_floor=TARGET,
                        copy_gbps=ceiling,
                        timing="cuda events (do_bench, L2 flushed)",
                    )  # fmt: skip
                )
            del logits
            torch.cuda.empty_cache()
    path = write_results("logprob_backward_quick" if quick else "logprob_backward", rows)
    print(table(rows, ["provider", "dtype", "batch", "us_p20", "us_p50", "us_p80", "floor_us", "x_floor"]))
    print(f"copy ceiling {ceiling:.0f} GB/s (read + write); results: {path}")


if __name__ == "__main__":
    main()
