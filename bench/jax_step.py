"""What replay adds to a realistic jitted JAX decode step, by mechanism; and eager host cost.

Question: how much does replay add per decode step (a) with one jitted step per Python call
("dispatch": wall clock, what a host-bound loop sees; "dispatch_device": device time, host
hidden) and (b) with 32 steps inside one ``lax.fori_loop`` ("loop"), for this library's path and
for the other ways to run the same replay inside XLA? And how much host time does one eager
replay call cost?

Step (FACTS.md): B = 256 rows, 8 bf16 matmuls 256x1024x1024 with tanh, a projection to 32,000
logits, argmax to int32, then replay; the next hidden state is the embedding of the replayed
token and each row's ``total_len`` advances by one, so steps depend on each other as in a real
loop. Table: 1024 slots x 8192 tokens, every slot traced; steps before, inside and past the
traces; 16 padding rows (-1).

Mechanisms (same tokens expected from all; ``tokens_match`` compares 32 steps with plain_jnp):
- ``none``: the step without replay (the baseline the others are compared with).
- ``trace_replay_jax``: this library, ``trace_replay_jax.replay(tables, ...)``: gather + select
  in jnp on zero-copy JAX views of the core's table, fused by XLA.
- ``trace_replay_jax_kernel``: this library with ``method="kernel"``: the core's Triton kernel
  through its command-buffer-compatible ``buffer_callback`` (a bound launch per buffer layout).
- ``plain_jnp``: the same replay written directly in jnp on a table JAX owns.
- ``buffer_callback``: the core's compiled Triton kernel launched on ``ctx.stream`` from
  ``jax.experimental.buffer_callback`` (a Python call per step).
- ``buffer_callback_cmdbuf``: the same with ``command_buffer_compatible=True`` (recorded once per
  buffer layout, then replayed by XLA without Python).
- ``jax_triton``: jax-triton's ``triton_call`` of the same kernel (only when ``jax_triton`` is
  importable; in its own process with its own ``none``/``plain_jnp`` baseline, because importing
  it sets ``TRITON_CACHE_DIR=""``; default flags only).
Each runs under two XLA flag sets: ``default`` and ``command_buffers`` (command buffers for
fusions, cuBLAS, custom calls, loops and conditionals, minimum graph size 1).

Eager host time (default flags): host time per call of ``TraceReplayState.replay`` (one jitted
dispatch; both methods) and of the alternatives: the core's kernel reached over DLPack
(``__dlpack__(copy=True)`` export, replay on a side stream, ``jax.dlpack.from_dlpack`` back with the stream handshake),
and a jitted ``buffer_callback`` replay called eagerly.

Method: "dispatch" and "loop": wall clock per step over back-to-back calls, the device
synchronised at the end of each round and counted. On the H200 one dispatch (~130-150 us of
host) outlasts the step (~105 us), so "dispatch" is host-bound: it shows what a one-call-per-step
user sees, and its ``added_us_p50`` is mostly host noise. "dispatch_device": the same calls
queued behind a busy program, device time per step with the host hidden (``jax_step_timing``
says how; trust a row only where ``host_hidden`` is True). All modes: mechanisms interleaved
round by round; p20/p50/p80 over rounds; ``added_us_p50`` is the difference of medians with
``none`` in the same flag set and mode. Eager host time: calls in a round without
synchronisation, the device synchronised between rounds (not counted).

Run: ``python bench/jax_step.py`` on the GPU (about 2-3 minutes, three child processes; writes
``bench/results/jax_step.json``; ``bench/run_all.sh`` gives it 400 s).
To include jax-triton, make its wheel importable (``PYTHONPATH``) first. ``--smoke`` runs a tiny
version on the CPU and writes nothing (its "dispatch_device" rows carry ``smoke=True``: XLA's CPU
runtime need not queue programs as a GPU stream does, so they only exercise the code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_args, percentiles, write_results  # noqa: E402
from jax_step_replays import Setup, eager_rows, make_replay  # noqa: E402
from jax_step_timing import make_busy, queued_sample  # noqa: E402

FULL = dict(
    batch=256,
    hidden=1024,
    layers=8,
    vocab=32_000,
    max_slots=1024,
    max_trace_len=8192,
    loop_steps=32,
    pad_rows=16,
    rounds=15,
    dispatch_calls=200,
    loop_calls=8,
    eager_calls=1000,
    queue_steps=24,
    busy_size=4096,
    busy_calib_iters=16,
    busy_min_us=3000.0,
)
SMOKE = dict(
    batch=16,
    hidden=64,
    layers=2,
    vocab=500,
    max_slots=32,
    max_trace_len=64,
    loop_steps=4,
    pad_rows=2,
    rounds=3,
    dispatch_calls=5,
    loop_calls=2,
    eager_calls=50,
    queue_steps=3,
    busy_size=32,
    busy_calib_iters=64,
    busy_min_us=200.0,
)
CMD_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL "
    "--xla_gpu_graph_min_graph_size=1"
)
GPU_MECHANISMS = (
    "none",
    "trace_replay_jax",
    "trace_replay_jax_kernel",
    "plain_jnp",
    "buffer_callback",
    "buffer_callback_cmdbuf",
)
CPU_MECHANISMS = ("none", "trace_replay_jax", "trace_replay_jax_kernel", "plain_jnp")


def make_step_fns(replay, setup):
    """(dispatch_fn, loop_fn): one step per call, and ``loop_steps`` steps per call."""
    import jax
    import jax.numpy as jnp

    c = setup.cfg
    n_slots = setup.state.max_slots

    def step(params, tables, x, total, prompt, idx):
        h = x
        for w in params["w"]:
            h = jnp.tanh(jnp.dot(h, w, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
        logits = jnp.dot(h, params["w_out"], preferred_element_type=jnp.float32)
        sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = replay(tables, sampled, idx, total, prompt)
        total = total.at[jnp.where(idx >= 0, idx, n_slots)].add(1, mode="drop")
        return params["emb"][tokens], total, tokens

    def loop(params, tables, x, total, prompt, idx):
        def body(k, carry):
            x, total, toks = carry
            x, total, t = step(params, tables, x, total, prompt, idx)
            return x, total, toks.at[k].set(t)

        toks = jnp.zeros((c["loop_steps"], c["batch"]), jnp.int32)
        return jax.lax.fori_loop(0, c["loop_steps"], body, (x, total, toks))

    return jax.jit(step), jax.jit(loop)


def child(cfg, config_name, mechanisms, out_path, process, smoke=False):
    import jax

    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        device = jax.devices("cpu")[0]
    setup = Setup(cfg, device)
    rows = []
    runners = {}
    reference = None
    for name in mechanisms:
        row = dict(config=config_name, mechanism=name, process=process)
        try:
            replay = make_replay(name, setup)
            dispatch, loop = make_step_fns(replay, setup)
            args = (setup.params, setup.state.tables if name != "plain_jnp" else setup.owned)
            _, _, toks = loop(*args, setup.x0, setup.total0, setup.prompt, setup.idx)  # compile + check
            x, total, _ = dispatch(*args, setup.x0, setup.total0, setup.prompt, setup.idx)
            jax.block_until_ready((toks, x, total))
            toks = np.asarray(toks)
            if name == "plain_jnp":
                reference = toks
            runners[name] = (dispatch, loop, args, toks)
        except Exception as exc:  # noqa: BLE001 - a broken candidate is a result, not a crash
            rows.append(dict(row, mode="compile", error=f"{type(exc).__name__}: {exc}"[:2000]))
            traceback.print_exc()
    times = {(n, m): [] for n in runners for m in ("dispatch", "loop")}
    busy, queued = None, {n: [] for n in runners}  # queued: queued_sample()s, one a round
    k = cfg["queue_steps"]
    if runners:
        try:
            busy, host_k_us = make_busy(cfg, device, runners, setup)
        except Exception as exc:  # noqa: BLE001
            rows.extend(
                dict(
                    config=config_name,
                    mechanism=n,
                    mode="dispatch_device",
                    process=process,
                    error=f"busy program: {type(exc).__name__}: {exc}"[:2000],
                )
                for n in runners
            )
            traceback.print_exc()
    for _ in range(cfg["rounds"]):
        for name, (dispatch, loop, args, _) in runners.items():
            x, total = setup.x0, setup.total0
            jax.block_until_ready(dispatch(*args, x, total, setup.prompt, setup.idx))
            t0 = time.perf_counter()
            for _ in range(cfg["dispatch_calls"]):
                x, total, toks = dispatch(*args, x, total, setup.prompt, setup.idx)
            toks.block_until_ready()
            times[name, "dispatch"].append((time.perf_counter() - t0) / cfg["dispatch_calls"] * 1e6)
            x, total = setup.x0, setup.total0
            t0 = time.perf_counter()
            for _ in range(cfg["loop_calls"]):
                x, total, toks = loop(*args, x, total, setup.prompt, setup.idx)
            toks.block_until_ready()
            times[name, "loop"].append((time.perf_counter() - t0) / (cfg["loop_calls"] * cfg["loop_steps"]) * 1e6)
            if busy is not None:
                queued[name].append(queued_sample(busy, dispatch, args, setup, k))
    for (name, mode), samples in times.items():
        toks = runners[name][3]
        match = None if reference is None or name == "none" else bool(np.array_equal(toks, reference))
        rows.append(
            dict(
                config=config_name,
                mechanism=name,
                mode=mode,
                tokens_match=match,
                process=process,
                steps_per_call=1 if mode == "dispatch" else cfg["loop_steps"],
                **percentiles(samples),
            )
        )
    for name, samples in queued.items():
        if busy is None or not samples:
            continue
        t_alone, t_queued, busy_disp, enq = (np.asarray(v) for v in zip(*samples))
        hidden = busy_disp + enq < t_alone
        per_step = (t_queued - t_alone) / k
        match = None if reference is None or name == "none" else bool(np.array_equal(runners[name][3], reference))
        rows.append(
            dict(
                config=config_name,
                mechanism=name,
                mode="dispatch_device",
                tokens_match=match,
                process=process,
                steps_per_call=1,
                queue_steps=k,
                busy_iters=busy.iters,
                busy_target_us=busy.target_us,
                host_k_steps_us=host_k_us,
                busy_us_p50=float(np.median(t_alone)),
                busy_us_min=float(t_alone.min()),
                busy_dispatch_us_max=float(busy_disp.max()),
                enqueue_us_p50=float(np.median(enq)),
                enqueue_us_max=float(enq.max()),
                # rounds whose host was done queueing before the busy program alone was done;
                # only those are device time, and only those are counted
                rounds_hidden=int(hidden.sum()),
                rounds=len(hidden),
                host_hidden=bool(hidden.sum() >= max(3, len(hidden) // 2)),
                smoke=smoke,
                **percentiles(per_step[hidden] if hidden.any() else per_step),
            )
        )
    if config_name == "default" and process == "main":
        rows.extend(dict(r, process=process) for r in eager_rows(cfg, setup, device))
    with open(out_path, "w") as f:
        json.dump(rows, f)


# -- the parent -----------------------------------------------------------------------------------
def run_child(config_name, flags, mechanisms, smoke, timeout, process="main"):
    env = dict(os.environ)
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            config_name,
            "--out",
            out,
            "--mechanisms",
            ",".join(mechanisms),
            "--process",
            process,
        ] + (["--smoke"] if smoke else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"--- {config_name} {mechanisms}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return [
            dict(config=config_name, mechanism=m, mode="child", process=process, error=f"child exit {rc}")
            for m in mechanisms
        ]


def _probe(code: str) -> bool:
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def jax_triton_available() -> bool:
    return _probe("import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('jax_triton') else 1)")


def jax_sees_a_gpu() -> bool:
    # In a child: initialising JAX's GPU backend here would take most of the GPU memory away
    # from the children that measure.
    return _probe("import jax; jax.devices('gpu')")


def summarise(rows):
    key = lambda r: (r["config"], r["mode"], r.get("process"))  # noqa: E731
    base = {key(r): r["us_p50"] for r in rows if r.get("mechanism") == "none" and "us_p50" in r}
    for r in rows:
        if "us_p50" in r and key(r) in base and r["mode"] != "eager_host":
            r["added_us_p50"] = r["us_p50"] - base[key(r)]
    return rows


def describe(r) -> str:
    """One printed line per row."""
    head = f"{r['config']:16s} {r.get('process')!s:10s} {r['mechanism']:31s} {r['mode']:15s}"
    if "us_p50" not in r:
        return f"{head} ERROR {r.get('error')}"
    line = (
        f"{head} p50 {r['us_p50']:9.2f} us/step (p20 {r['us_p20']:.2f}, p80 {r['us_p80']:.2f})  "
        f"added {r.get('added_us_p50', float('nan')):7.2f}  tokens_match={r.get('tokens_match')}"
    )
    if r["mode"] == "dispatch_device":
        line += (
            f"  busy {r['busy_us_p50']:.0f} us, enqueue max {r['enqueue_us_max']:.0f} us, "
            f"host_hidden={r['host_hidden']} ({r['rounds_hidden']}/{r['rounds']} rounds)"
            + (" (smoke)" if r.get("smoke") else "")
            + ("" if r["host_hidden"] else "  WARNING: host not hidden, not device time")
        )
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU is fine, writes nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--mechanisms", help=argparse.SUPPRESS)
    ap.add_argument("--process", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=240.0, help="seconds per child process")
    a = parse_args(__doc__, ap)
    cfg = SMOKE if a.smoke else FULL
    if a.child:
        child(cfg, a.child, a.mechanisms.split(","), a.out, a.process, smoke=a.smoke)
        return
    gpu = jax_sees_a_gpu()
    if not gpu and not a.smoke:
        print(
            "jax_step: no GPU visible to JAX; this benchmark runs on a GPU (use --smoke to check the script on a CPU)",
            flush=True,
        )
        return
    mechanisms = GPU_MECHANISMS if gpu else CPU_MECHANISMS
    rows = []
    configs = [("default", "")] + ([("command_buffers", CMD_BUFFER_FLAGS)] if gpu else [])
    for name, flags in configs:
        rows += run_child(name, flags, mechanisms, a.smoke, a.child_timeout)
    if gpu and jax_triton_available():  # default flags only: FACTS.md has it under command buffers
        rows += run_child(
            "default", "", ("plain_jnp", "none", "jax_triton"), a.smoke, a.child_timeout, process="jax_triton"
        )
    elif gpu:
        rows.append(
            dict(
                config="default",
                mechanism="jax_triton",
                mode="child",
                process="jax_triton",
                error="jax_triton not importable here (carry its wheel to measure it)",
            )
        )
    rows = summarise(rows)
    for r in rows:
        print(describe(r), flush=True)
    if a.smoke:
        return
    shape = {k: FULL[k] for k in ("batch", "hidden", "layers", "vocab", "max_slots", "max_trace_len", "loop_steps")}
    print("wrote", write_results("jax_step", [dict(r, **shape) for r in rows]))


if __name__ == "__main__":
    main()
