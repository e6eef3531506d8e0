"""Logprob and rank of one token per row: this library's batch-invariant kernels vs torch vs jnp.

Question: how close does ``token_logprob_rank`` come to the memory limit at vocab 151,936, for
batch 1 to 4096, bfloat16 and float32 logits, and what does top-k 20 add? Targets (issue 16,
device time): batch 1 <= 6 us; batch 256 >= 3.6 TB/s of logits read; batch 4096 <= 300 us (bf16);
float32 at batch 256 near the copy ceiling; top-k 20 at batch 256 <= 1.5x the plain call; each
row's entropy (``entropy=True``) at batch 256 and 4096 <= 1.15x the plain call (bf16). The floor
is ``bytes / copy ceiling``: each logit is read once.

Providers: ``trace_replay`` (``trace_replay_torch.token_logprob_rank(logits, ids, out=...)``,
bound once per tensor layout, so a call only launches), ``trace_replay_topk20`` (``top_k=20``),
``trace_replay_argmax`` (``argmax=True``, every other row greedy: a greedy sampler and the
logprob/rank in one pass; ``torch_argmax`` is ``logits.argmax(-1)`` alone, so the difference is
what scoring adds to a greedy step), ``trace_replay_entropy`` (``entropy=True``: each row's
entropy from the same read), ``torch`` (float32 ``log_softmax`` + ``gather`` + a ``>=``
count), ``trace_replay_unaligned`` / ``torch_unaligned`` (rows not 16-byte aligned,
``UNALIGNED``: GPT-2's 50,257 logits per row, and 151,936 in rows of 151,937; batch 1, 256,
4096), and ``trace_replay_jax_kernel`` / ``trace_replay_jax_jnp`` (``jax.jit`` of
``trace_replay_jax.token_logprob_rank(logits, ids, method=...)``).

Timings (the ``timing`` field of every row): ``cuda events, queued behind a busy kernel``
(``harness.time_cuda_queued``; the targets use it): 20 back-to-back calls queued while a sleep
kernel holds the device, inputs rotated through copies of the logits (256 MiB in all, at most
32) so that L2 serves small batches less; ``cuda events (do_bench, L2 flushed)``
(``harness.time_cuda``): one call at a time; JAX rows: wall clock per call over back-to-back
calls of the jitted function on rotated copies.

Reported: p20/p50/p80 in us and GB/s of logits read, next to the ceiling
``harness.copy_bandwidth()["d2d"]`` (bytes read + written per second). ``ranks_equal_to_kernel`` /
``max_abs_logprob_diff_to_kernel`` compare each provider with the kernel; ``invariant`` says
whether the batch's rows give the same bits in other batches (``harness.rows_same_bits``).

Run: ``python bench/logprob_rank.py`` on a GPU; writes ``bench/results/logprob_rank.json``.
``python bench/logprob_rank.py --entropy`` times only ``trace_replay`` and ``trace_replay_entropy``
side by side (both dtypes, every batch; no JAX, no unaligned rows) with the entropy targets, and
writes ``bench/results/logprob_rank_entropy.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    bandwidth,
    copy_bandwidth,
    provenance,
    rotating,
    rows_same_bits,
    table,
    time_cuda,
    time_cuda_queued,
    write_results,
)
from logprob_peers import make_jax_fns, time_wall, torch_logprob_rank  # noqa: E402

VOCAB = 151_936
BATCHES = tuple(int(b) for b in os.environ.get("LOGPROB_BENCH_BATCHES", "1,64,256,1024,4096").split(","))
DTYPES = ("bfloat16", "float32")
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32
QUEUED = "cuda events, queued behind a busy kernel"
DO_BENCH = "cuda events (do_bench, L2 flushed)"
TOP_K = 20
ENTROPY_LIMIT = 1.15  # entropy=True over the plain call, bf16, at ENTROPY_BATCHES
ENTROPY_BATCHES = (256, 4096)
ENTROPY_PROVIDERS = ("trace_replay", "trace_replay_entropy")
# Rows that are not 16-byte aligned (bfloat16: the fused path, shifted; float32: the element
# path, a logit per load): GPT-2's vocabulary, and 151,936 logits in rows padded to 151,937 (a
# view of a wider buffer): (vocabulary, row stride) in elements.
UNALIGNED = ((50_257, 50_257), (VOCAB, VOCAB + 1))
UNALIGNED_BATCHES = (1, 256, 4096)


def compare(ref, got):
    """(ranks equal, largest |logprob difference|) between two (logprobs, ranks) results on host."""
    ref_lp, ref_rk = (np.asarray(a, dtype=np.float64) for a in ref)
    lp, rk = (np.asarray(a, dtype=np.float64) for a in got)
    return bool(np.array_equal(ref_rk, rk)), float(np.nanmax(np.abs(ref_lp - lp)))


def invariant(fn, logits, ids, result) -> bool:
    """Whether the batch's rows give the bits they have in the batch in other batches
    (``harness.rows_same_bits``: every row at another position, three rows alone, a sub-batch)."""
    return rows_same_bits(lambda rows: fn(logits[rows].clone(), ids[rows].clone()), result, logits.shape[0])


def add_row(rows, base, ours, provider, timing, stats, result=None, inv=None):
    """Append and print one provider's row: its timing ``stats``, GB/s of the logits read,
    ``invariant`` (``inv``; None where not checked) and, for another implementation's ``result``,
    whether its ranks equal the kernel's (``ours``) and how far its logprobs are."""
    same, diff = compare(ours, result) if result is not None else (True, 0.0)
    bw = bandwidth(base["bytes"], stats)
    rows.append(
        dict(
            base,
            provider=provider,
            timing=timing,
            gbps=bw["gbps_p50"],
            invariant=inv,
            ranks_equal_to_kernel=same,
            max_abs_logprob_diff_to_kernel=diff,
            **stats,
            **bw,
        )
    )
    where = f"vocab {base['vocab']} stride {base['row_stride']} " if "row_stride" in base else ""
    print(
        f"{provider:24s} {timing[:20]:20s} {where}{base['dtype']:9s} B={base['batch']:5d} p50 "
        f"{stats['us_p50']:9.2f} us [{stats['us_p20']:.2f}, {stats['us_p80']:.2f}] {bw['gbps_p50']:7.0f} GB/s  "
        f"invariant: {inv}  ranks equal: {same}, max |dlogprob| {diff:.2e}",
        flush=True,
    )


def bench_batch(rows, dev, dtype_name: str, batch: int, copy_gbps: float, jax_fns, only=None) -> None:
    """Append the rows of every provider at one dtype and batch, vocabulary VOCAB (of the
    providers named in ``only``, where given)."""
    import torch

    from trace_replay_torch import token_logprob_rank

    dtype = getattr(torch, dtype_name)
    logits = (torch.randn(batch, VOCAB, device=dev) * 4).to(dtype)
    ids = torch.randint(0, VOCAB, (batch,), device=dev)
    nbytes = logits.numel() * logits.element_size()
    n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
    copies = [logits] + [logits.clone() for _ in range(n_copies - 1)]
    out = (torch.empty(batch, device=dev), torch.empty(batch, dtype=torch.int64, device=dev))
    out_k = out + (
        torch.empty(batch, TOP_K, device=dev),
        torch.empty(batch, TOP_K, dtype=torch.int64, device=dev),
    )
    ours = tuple(t.cpu().numpy() for t in token_logprob_rank(logits, ids, out=out))
    ours_inv = invariant(lambda x, i: token_logprob_rank(x, i), logits, ids, token_logprob_rank(logits, ids))
    gids = ids.clone()
    gids[1::2] = -1  # greedy rows, scored as their argmax
    out_a = out + (torch.empty(batch, dtype=torch.int64, device=dev),)
    argmax_inv = invariant(
        lambda x, i: token_logprob_rank(x, i, argmax=True),
        logits,
        gids,
        token_logprob_rank(logits, gids, argmax=True),
    )
    topk_inv = invariant(
        lambda x, i: token_logprob_rank(x, i, top_k=TOP_K),
        logits,
        ids,
        token_logprob_rank(logits, ids, top_k=TOP_K),
    )
    out_e = out + (torch.empty(batch, device=dev),)
    entropy_inv = invariant(
        lambda x, i: token_logprob_rank(x, i, entropy=True),
        logits,
        ids,
        token_logprob_rank(logits, ids, entropy=True),
    )
    naive = tuple(t.cpu().numpy() for t in torch_logprob_rank(logits, ids))
    base = dict(
        batch=batch,
        vocab=VOCAB,
        dtype=dtype_name,
        bytes=nbytes,
        copy_gbps=copy_gbps,
        floor_us=nbytes / copy_gbps / 1e3,
    )

    def record(provider, timing, stats, result, inv=None):
        add_row(rows, base, ours, provider, timing, stats, result, inv)

    providers = [
        ("trace_replay", lambda x: token_logprob_rank(x, ids, out=out), None, ours_inv),
        (
            f"trace_replay_topk{TOP_K}",
            lambda x: token_logprob_rank(x, ids, top_k=TOP_K, out=out_k),
            None,
            topk_inv,
        ),
        ("torch", lambda x: torch_logprob_rank(x, ids), naive, None),
        (
            "trace_replay_argmax",
            lambda x: token_logprob_rank(x, gids, argmax=True, out=out_a),
            None,
            argmax_inv,
        ),
        ("torch_argmax", lambda x: x.argmax(-1), None, None),
        ("trace_replay_entropy", lambda x: token_logprob_rank(x, ids, entropy=True, out=out_e), None, entropy_inv),
    ]
    if only is not None:
        providers = [p for p in providers if p[0] in only]
    for name, fn, result, inv in providers:
        record(name, QUEUED, time_cuda_queued(rotating([lambda x=x, fn=fn: fn(x) for x in copies])), result, inv)
        if name == "trace_replay":
            record(name, DO_BENCH, time_cuda(lambda fn=fn: fn(logits)), result, inv)
    if jax_fns and batch <= 1024 and only is None:
        import jax

        ids32 = ids.to(torch.int32)
        torch.cuda.synchronize()
        xs_j = [jax.dlpack.from_dlpack(c) for c in copies[:8]]
        ids_j = jax.dlpack.from_dlpack(ids32)
        for name, fn in jax_fns.items():
            result = tuple(np.asarray(a) for a in fn(xs_j[0], ids_j))
            inv = None
            if name.endswith("_kernel"):
                one = tuple(np.asarray(a) for a in fn(xs_j[0][-1:], ids_j[-1:]))
                inv = bool(one[0].tobytes() == result[0][-1:].tobytes())
            stats = time_wall(rotating([lambda x_j=x_j, fn=fn: fn(x_j, ids_j) for x_j in xs_j]))
            record(name, f"wall clock incl. dispatch, {len(xs_j)} copies rotated", stats, result, inv)
        del xs_j, ids_j, ids32


def bench_unaligned(rows, dev, vocab: int, stride: int, dtype_name: str, batch: int, copy_gbps: float) -> None:
    """Append the rows of rows of ``vocab`` logits ``stride`` elements apart (not 16-byte aligned)."""
    import torch

    from trace_replay_torch import token_logprob_rank

    wide = (torch.randn(batch, stride, device=dev) * 4).to(getattr(torch, dtype_name))
    logits = wide[:, :vocab]
    ids = torch.randint(0, vocab, (batch,), device=dev)
    nbytes = logits.numel() * logits.element_size()
    n_copies = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // nbytes)))
    copies = [logits] + [wide.clone()[:, :vocab] for _ in range(n_copies - 1)]
    out = (torch.empty(batch, device=dev), torch.empty(batch, dtype=torch.int64, device=dev))
    ours = tuple(t.cpu().numpy() for t in token_logprob_rank(logits, ids, out=out))
    # the rows in other batches of the same layout (fresh rows of ``stride`` elements)
    inv = rows_same_bits(
        lambda rows: token_logprob_rank(wide[rows].clone()[:, :vocab], ids[rows].clone()),
        token_logprob_rank(logits, ids),
        batch,
    )
    base = dict(batch=batch, vocab=vocab, row_stride=stride, dtype=dtype_name, bytes=nbytes, copy_gbps=copy_gbps)
    base["floor_us"] = nbytes / copy_gbps / 1e3
    naive = tuple(t.cpu().numpy() for t in torch_logprob_rank(logits, ids))
    for provider, fn, result, row_inv in (
        ("trace_replay_unaligned", lambda x: token_logprob_rank(x, ids, out=out), None, inv),
        ("torch_unaligned", lambda x: torch_logprob_rank(x, ids), naive, None),
    ):
        stats = time_cuda_queued(rotating([lambda x=x, fn=fn: fn(x) for x in copies]))
        add_row(rows, base, ours, provider, QUEUED, stats, result, row_inv)


def entropy_targets(rows, pick) -> None:
    """Append and print the entropy targets: ``entropy=True`` over the plain call (bf16, p50,
    queued) at :data:`ENTROPY_BATCHES`, limit :data:`ENTROPY_LIMIT`; and the ratio at every batch
    and dtype timed, as ``entropy_over_plain`` rows."""
    for dtype_name in DTYPES:
        for batch in BATCHES:
            plain, ent = pick("trace_replay", batch, dtype_name), pick("trace_replay_entropy", batch, dtype_name)
            if not (plain and ent):
                continue
            ratio = ent["us_p50"] / plain["us_p50"]
            base = dict(batch=batch, vocab=VOCAB, dtype=dtype_name, timing=QUEUED, value=ratio)
            rows.append(dict(base, provider="entropy_over_plain", field="entropy_over_plain"))
            if dtype_name == "bfloat16" and batch in ENTROPY_BATCHES:
                met = bool(ratio <= ENTROPY_LIMIT)
                rows.append(dict(base, provider="target", field="entropy_over_plain", limit=ENTROPY_LIMIT, met=met))
            print(
                f"{dtype_name:9s} B={batch:5d}: entropy {ent['us_p50']:.2f} us, plain {plain['us_p50']:.2f} us: "
                f"{ratio:.3f}x",
                flush=True,
            )


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--entropy",
        action="store_true",
        help="time only the plain call and entropy=True side by side (writes results/logprob_rank_entropy.json)",
    )
    entropy_only = parser.parse_args().entropy
    if not torch.cuda.is_available():
        sys.exit("bench/logprob_rank.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []
    copy = copy_bandwidth()["d2d"]
    copy_gbps = copy["gbps_p50"]
    timing = "cuda events; GB/s counts bytes read + written"
    rows.append(dict(copy, provider="d2d_copy", batch=None, vocab=None, dtype=None, gbps=copy_gbps, timing=timing))
    print(f"device-to-device copy: p50 {copy['us_p50']:.1f} us = {copy_gbps:.0f} GB/s (read + write)", flush=True)
    jax_fns, jax_why = ({}, "--entropy") if entropy_only else make_jax_fns()
    if not jax_fns:
        print(f"jax providers skipped: {jax_why}", flush=True)

    for dtype_name in DTYPES:
        for batch in BATCHES:
            bench_batch(rows, dev, dtype_name, batch, copy_gbps, jax_fns, ENTROPY_PROVIDERS if entropy_only else None)
            torch.cuda.empty_cache()  # the batch's arrays are gone with its call

    def pick(provider, batch, dtype_name):
        want = (provider, QUEUED, batch, dtype_name)
        return next((r for r in rows if (r["provider"], r.get("timing"), r["batch"], r["dtype"]) == want), None)

    if entropy_only:
        entropy_targets(rows, pick)
        path = write_results("logprob_rank_entropy", rows)
        print(f"\nwrote {path}\n")
        print(table([r for r in rows if r["provider"] in ENTROPY_PROVIDERS], ["provider", "dtype", "batch", "us_p50"]))
        print(
            table([r for r in rows if r["provider"] == "target"], ["dtype", "batch", "field", "value", "limit", "met"])
        )
        return
    for vocab, stride in UNALIGNED:  # rows not 16-byte aligned
        for dtype_name in DTYPES:
            for batch in UNALIGNED_BATCHES:
                bench_unaligned(rows, dev, vocab, stride, dtype_name, batch, copy_gbps)
                torch.cuda.empty_cache()

    targets = [
        ("bfloat16", 1, "us_p50", "<=", 6.0),
        ("bfloat16", 256, "gbps", ">=", 3600.0),
        ("bfloat16", 4096, "us_p50", "<=", 300.0),
        ("float32", 256, "fraction_of_copy", ">=", 0.95),
    ]
    for dtype_name, batch, field, op, limit in targets:
        r = pick("trace_replay", batch, dtype_name)
        if r is None:
            continue
        value = r["gbps"] / copy_gbps if field == "fraction_of_copy" else r[field]
        rows.append(
            dict(
                provider="target",
                batch=batch,
                vocab=VOCAB,
                dtype=dtype_name,
                timing=QUEUED,
                field=field,
                value=value,
                limit=limit,
                met=bool(value <= limit if op == "<=" else value >= limit),
                fraction_of_copy=r["gbps"] / copy_gbps,
            )
        )
    plain, topk = pick("trace_replay", 256, "bfloat16"), pick(f"trace_replay_topk{TOP_K}", 256, "bfloat16")
    if plain and topk:
        ratio = topk["us_p50"] / plain["us_p50"]
        target = dict(provider="target", batch=256, vocab=VOCAB, dtype="bfloat16", timing=QUEUED)
        rows.append(dict(target, field=f"topk{TOP_K}_over_plain", value=ratio, limit=1.5, met=bool(ratio <= 1.5)))

    entropy_targets(rows, pick)
    for batch in BATCHES:  # what scoring adds to a greedy pass that reads the logits anyway
        fused, alone = pick("trace_replay_argmax", batch, "bfloat16"), pick("torch_argmax", batch, "bfloat16")
        if fused and alone:
            rows.append(
                dict(
                    provider="argmax_fused_minus_torch_argmax",
                    batch=batch,
                    vocab=VOCAB,
                    dtype="bfloat16",
                    timing=QUEUED,
                    us_p50=fused["us_p50"] - alone["us_p50"],
                    fused_us_p50=fused["us_p50"],
                    torch_argmax_us_p50=alone["us_p50"],
                )
            )
            print(
                f"bf16 B={batch}: greedy + logprob/rank in one pass {fused['us_p50']:.2f} us, torch argmax alone "
                f"{alone['us_p50']:.2f} us: scoring adds {fused['us_p50'] - alone['us_p50']:.2f} us",
                flush=True,
            )

    path = write_results("logprob_rank", rows)
    prov = provenance()
    print(f"\nwrote {path}\n{prov['gpu']}, driver {prov['driver']}, {prov['versions']}, {prov['date']}\n")
    print(
        table(
            [r for r in rows if r["provider"] not in ("target", "entropy_over_plain")],
            ["provider", "timing", "dtype", "batch", "us_p50", "us_p20", "us_p80", "gbps", "invariant"],
        )
    )
    print(f"\ncopy ceiling: {copy_gbps:.0f} GB/s (read + write); JAX rows are wall clock incl. dispatch\n")
    print(table([r for r in rows if r["provider"] == "target"], ["dtype", "batch", "field", "value", "limit", "met"]))


if __name__ == "__main__":
    main()
