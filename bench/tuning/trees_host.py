"""Two trees of this project measured side by side on one GPU: host time of the decode step's calls.

Question: did a change of the library move the host time a decode loop pays per step? Each tree
(a checkout or an archive of a commit) is measured in its own child process, with the same timing
code (this file), in the order A B B A (``--repeat``: that many times), so drift of the machine
falls on both alike; each row reports the median over all children of the per-round means and
the ratio of the second tree to the first.

Rows (torch, bf16 logits of 32,000 columns, 1,024 slots of up to 8,192 trace tokens):
``replay`` (``TraceReplayState.replay``) at batch 1, 256 and 1,024; ``core_bound`` (the core's
bound launch without the adapter) at 256; ``sampler_eager`` (``argmax``, ``replay``,
``token_logprob_rank``) at 1, 256 and 1,024 (device-bound at 1,024); ``logprob_device``: the
logprob op's device time (CUDA events, the host hidden) on bf16 logits of 151,936 columns at
batch 256 and 4,096. With ``--jax``, each tree's own ``bench/jax_step.py`` child (default XLA
flags, ``none``, ``trace_replay_jax``, ``trace_replay_jax_kernel``) runs once per tree after the
torch rows, and its rows are printed side by side.

Run on a GPU: ``python3 bench/tuning/trees_host.py --trees base=/path/a,main=. [--jax] --out F``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SLOTS, TRACE_LEN, VOCAB = 1024, 8192, 32_000
ROUNDS, CALLS, WARMUP = 15, 2000, 200


def _time_host(fn, sync) -> list[float]:
    for _ in range(WARMUP):
        fn()
    per_round = []
    for _ in range(ROUNDS):
        sync()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per_round.append((time.perf_counter() - t0) / CALLS * 1e6)
    sync()
    return per_round


def _time_device(fn, torch) -> list[float]:
    """Device us per call of ``fn``: CUDA events around 50 back-to-back calls queued behind a
    sleep kernel (about 5 ms), so the host's enqueue is hidden; one figure per round."""
    for _ in range(3):
        fn()
    per_round = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10_000_000)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        per_round.append(start.elapsed_time(end) * 1e3 / 50)
    return per_round


def child(out: str) -> None:
    """Measure the tree on ``sys.path`` (the parent sets it) and write its rounds to ``out``."""
    import torch

    from trace_replay_torch import TraceReplayState, token_logprob_rank

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, TRACE_LEN + 1, SLOTS)
    prompt = rng.integers(1, 2000, SLOTS)
    total_len = torch.tensor(prompt + rng.integers(-2, TRACE_LEN + 2, SLOTS), dtype=torch.int32, device=dev)
    prompt_len = torch.tensor(prompt, dtype=torch.int32, device=dev)
    st = TraceReplayState(SLOTS, TRACE_LEN, device=dev, total_len=total_len, prompt_len=prompt_len)
    for slot, n in enumerate(lengths):
        st.add_request(slot, rng.integers(0, 150_000, n))
    st.apply_staged_writes()
    sync()
    rows = {}

    def eager(logits, idx):
        sampled = torch.argmax(logits, dim=-1)
        st.replay(sampled, idx)
        return (sampled, *token_logprob_rank(logits, sampled))

    for batch in (1, 256, 1024):
        idx = torch.tensor(rng.permutation(SLOTS)[:batch], dtype=torch.int32, device=dev)
        sampled = torch.tensor(rng.integers(0, 150_000, batch), dtype=torch.int64, device=dev)
        rows[f"replay B={batch}"] = _time_host(functools.partial(st.replay, sampled, idx), sync)
        if batch == 256:
            stream = torch.cuda.current_stream().cuda_stream
            bound = st.table.bind_replay(sampled, idx, total_len, prompt_len, stream=stream)
            rows[f"core_bound B={batch}"] = _time_host(functools.partial(bound, stream=stream), sync)
        logits = torch.randn(batch, VOCAB, device=dev).to(torch.bfloat16)
        rows[f"sampler_eager B={batch}"] = _time_host(functools.partial(eager, logits, idx), sync)
        tokens, logprobs, ranks = eager(logits, idx)  # traced ids past VOCAB: logprob NaN by contract
        rows[f"sampler_eager B={batch} checksum"] = [
            float(t.double().nansum().item()) for t in (tokens, logprobs, ranks)
        ]
    for batch in (256, 4096):  # the logprob op's device time, bf16 logits of Qwen's vocabulary
        logits = torch.randn(batch, 151_936, device=dev).to(torch.bfloat16)
        ids = torch.randint(0, 151_936, (batch,), device=dev)
        rows[f"logprob_device B={batch} V=151936"] = _time_device(
            functools.partial(token_logprob_rank, logits, ids), torch
        )
    st.close()
    with open(out, "w") as f:
        json.dump(rows, f)


def _env(tree: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, os.path.join(tree, "adapters"), os.path.join(tree, "bench")])
    return env


def _child(label: str, tree: str, cmd: list[str], timeout: float):
    """Run ``cmd + ["--out", file]`` in ``tree`` (its own packages first on the path); the JSON
    it wrote, or None when it wrote none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        t0 = time.perf_counter()
        try:
            rc: int | str = subprocess.run(cmd + ["--out", out], cwd=tree, env=_env(tree), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"--- {label}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        return json.load(open(out)) if os.path.exists(out) else None


def _run_child(name: str, tree: str, timeout: float) -> dict:
    return _child(name, tree, [sys.executable, os.path.abspath(__file__), "--child"], timeout) or {}


def _jax_rows(name: str, tree: str, timeout: float) -> list:
    mechanisms = "none,trace_replay_jax,trace_replay_jax_kernel"
    cmd = [sys.executable, "bench/jax_step.py", "--child", "default", "--mechanisms", mechanisms]
    return _child(f"{name} jax_step child", tree, cmd, timeout) or []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", help="NAME=PATH,NAME=PATH: the first is the reference")
    ap.add_argument("--jax", action="store_true", help="also each tree's bench/jax_step.py child")
    ap.add_argument("--repeat", type=int, default=1, help="children per tree: 2 x this (A B B A, repeated)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per child process")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.out)
        return
    trees = [tuple(t.split("=", 1)) for t in a.trees.split(",")]
    if len(trees) != 2 or any(len(t) != 2 for t in trees):
        ap.error(f"--trees must be NAME=PATH,NAME=PATH (got {a.trees!r})")
    (na, ta), (nb, tb) = [(n, os.path.abspath(p)) for n, p in trees]
    rounds: dict[str, dict[str, list[float]]] = {na: {}, nb: {}}
    for name, tree in ((na, ta), (nb, tb), (nb, tb), (na, ta)) * a.repeat:
        for key, values in _run_child(name, tree, a.timeout).items():
            rounds[name].setdefault(key, []).extend(values)
    torch_rows: list[dict] = []
    jax_rows: dict[str, list] = {}
    result = {"trees": {na: ta, nb: tb}, "torch": torch_rows, "jax": jax_rows}
    print(f"\nhost us per call, median of the rounds of both children [p20, p80]; ratio {nb} / {na}")
    for key in rounds[na]:
        a_, b_ = rounds[na].get(key), rounds[nb].get(key)
        if not a_ or not b_:
            continue
        if key.endswith("checksum"):
            print(f"{key:28s} {na} {a_} {nb} {b_} equal={a_ == b_}")
            torch_rows.append(dict(row=key, **{na: a_, nb: b_}))
            continue
        pa, pb = np.percentile(a_, [20, 50, 80]), np.percentile(b_, [20, 50, 80])
        row = dict(row=key, **{f"{na}_us": list(pa), f"{nb}_us": list(pb), "ratio_p50": pb[1] / pa[1]})
        torch_rows.append(row)
        print(f"{key:28s} {na} {pa[1]:8.2f} [{pa[0]:.2f}, {pa[2]:.2f}]  {nb} {pb[1]:8.2f} "
              f"[{pb[0]:.2f}, {pb[2]:.2f}]  ratio {pb[1] / pa[1]:.3f}")  # fmt: skip
    if a.jax:
        for name, tree in ((na, ta), (nb, tb)):
            jax_rows[name] = _jax_rows(name, tree, a.timeout)
        for name, rows in jax_rows.items():
            for r in rows:
                if "us_p50" in r:
                    print(f"jax {name:8s} {r['mechanism']:26s} {r['mode']:15s} p50 {r['us_p50']:9.2f} "
                          f"(p20 {r['us_p20']:.2f}, p80 {r['us_p80']:.2f}) match={r.get('tokens_match')}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
