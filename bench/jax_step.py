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
dispatch; both methods) and of the alternatives: the core's kernel reached over DLPack (``__dlpack__(copy=True)``
export, replay on a side stream, ``jax.dlpack.from_dlpack`` back with the stream handshake),
and a jitted ``buffer_callback`` replay called eagerly.

Method: "dispatch" and "loop": wall clock per step over back-to-back calls, the device
synchronised at the end of each round and counted. On the H200 one dispatch (~130-150 us of
host) outlasts the step (~105 us), so "dispatch" is host-bound: it shows what a one-call-per-step
user sees, and its ``added_us_p50`` is mostly host noise. "dispatch_device": the same calls with
the host hidden: a jitted busy program (a ``lax.fori_loop`` of bf16 matmuls on its own data,
sized once at start-up to 2.5x the host time of K = 24 dispatches, at least 3 ms) is dispatched,
then K dependent steps queue behind it on the device's one stream (K stays below JAX's ~32
programs in flight); T1 = busy + steps, dispatch to block; T0 = busy alone, same round; device
time per step = (T1 - T0) / K. It includes what replay adds on the device (kernels, launch gaps
inside a program, a ``buffer_callback``'s Python if it runs while the device is busy), not the
host's dispatch cost ("dispatch" shows that). A round whose host dispatch of busy + K steps
took longer than T0 timed host gaps, not device time: it is dropped (``rounds_hidden`` of
``rounds`` are kept), and ``host_hidden`` is False when fewer than half were kept (then do not
trust the row). All modes: mechanisms interleaved round by round; p20/p50/p80 over rounds;
``added_us_p50`` is the difference of medians with ``none`` in the same flag set and mode. Eager
host time: calls in a round without synchronisation, the device synchronised between rounds
(not counted).

Run: ``python bench/jax_step.py`` on the GPU (about 2-3 minutes, three child processes; writes
``bench/results/jax_step.json``; under ``bench/run_all.sh`` give it ``BENCH_TIMEOUT_S=400``).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

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
BUSY_HOST_FACTOR = 2.5  # the busy program lasts this many times the host time of queue_steps dispatches
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


def percentiles(samples):
    p20, p50, p80 = np.percentile(np.asarray(samples, dtype=np.float64), [20, 50, 80])
    return {"us_p20": float(p20), "us_p50": float(p50), "us_p80": float(p80), "n": len(samples)}


# -- the child: one XLA flag set, one process ---------------------------------------------------
class Setup:
    """Weights, inputs, a filled TraceReplayState and a JAX-owned copy of its table."""

    def __init__(self, cfg, device):
        import jax
        import jax.numpy as jnp

        from trace_replay_jax import TraceReplayState

        self.cfg = c = cfg
        rng = np.random.default_rng(0)
        put = lambda x, dt=None: jax.device_put(np.asarray(x, dt), device)  # noqa: E731
        h, v = c["hidden"], c["vocab"]
        self.params = {
            "w": [put(rng.standard_normal((h, h)) / np.sqrt(h), jnp.bfloat16) for _ in range(c["layers"])],
            "w_out": put(rng.standard_normal((h, v)) / np.sqrt(h), jnp.bfloat16),
            "emb": put(rng.standard_normal((v, h)), jnp.bfloat16),
        }
        self.x0 = put(rng.standard_normal((c["batch"], h)), jnp.bfloat16)
        slots, n = c["max_slots"], c["max_trace_len"]
        idx = rng.permutation(slots)[: c["batch"]]
        idx[rng.permutation(c["batch"])[: c["pad_rows"]]] = -1
        self.idx = put(idx, np.int32)
        prompt = rng.integers(1, 2000, slots)
        self.prompt = put(prompt, np.int32)
        lengths = rng.integers(1, n + 1, slots)
        self.total0 = put(prompt + (rng.random(slots) * (lengths + 4)).astype(np.int64) - 2, np.int32)
        self.state = TraceReplayState(slots, n, device=device, vocab_size=v)
        for slot in range(slots):
            self.state.add_request(slot, rng.integers(0, v, lengths[slot]))
        self.state.apply_staged_writes()
        table, trace_len = self.state.snapshot()
        self.owned = (put(table), put(trace_len))  # plain_jnp's table, owned by JAX
        jax.block_until_ready((self.owned, self.params, self.x0))


def plain_jnp_replay(table, trace_len, sampled, idx, total, prompt):
    import jax.numpy as jnp

    ok = idx >= 0
    slot = jnp.where(ok, idx, 0)
    step = total[slot] - prompt[slot]
    ok = ok & (step >= 0) & (step < trace_len[slot])
    return jnp.where(ok, table[slot, jnp.where(ok, step, 0)], sampled)


def buffer_callback_replay(setup, *, command_buffer: bool):
    """The core's compiled kernel, launched from a buffer_callback on XLA's stream."""
    import threading

    import jax
    from cuda.core import Device
    from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

    from trace_replay_core.kernels.replay import plan_replay, replay_compiled

    st = setup.state
    kernel = replay_compiled(st.device.local_hardware_id, "int32", "int32", ("int32", "int32"), None)
    rows = setup.cfg["batch"]
    grid = plan_replay(rows)
    table_view, lengths_view = st.table.device_views()
    fixed = (table_view.ptr, lengths_view.ptr, rows, st.max_slots, st.max_trace_len)
    device = Device(st.device.local_hardware_id)
    local = threading.local()

    def ptr(buf):
        return buf.__cuda_array_interface__["data"][0]

    def callback(ctx, out, sampled, idx, total, prompt):
        if getattr(ctx, "stage", ExecutionStage.EXECUTE) != ExecutionStage.EXECUTE:
            return
        if not getattr(local, "active", False):  # once per XLA thread: the CUDA context current
            device.set_current()
            local.active = True
        kernel.launch(grid, int(ctx.stream), ptr(out), ptr(idx), ptr(total), ptr(prompt), 0, *fixed)

    op = buffer_callback(
        callback,
        jax.ShapeDtypeStruct((rows,), np.int32),
        input_output_aliases={0: 0},
        command_buffer_compatible=command_buffer,
    )
    return lambda tables, sampled, idx, total, prompt: op(sampled, idx, total, prompt)


def jax_triton_replay(setup):
    """jax-triton's triton_call of the replay (a kernel that also takes the output pointer)."""
    import jax
    import jax_triton as jt  # noqa: F401 - sets TRITON_CACHE_DIR=""; only ever imported in this process
    import triton
    import triton.language as tl

    @triton.jit
    def replay_out(
        sampled_ptr,
        idx_ptr,
        total_ptr,
        prompt_ptr,
        table_ptr,
        trace_len_ptr,
        n_rows,
        max_slots,
        row_stride,
        out_ptr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_batch = rows < n_rows
        slot = tl.load(idx_ptr + rows, mask=in_batch, other=-1).to(tl.int64)
        active = in_batch & (slot >= 0) & (slot < max_slots)
        n = tl.load(trace_len_ptr + slot, mask=active, other=0).to(tl.int64)
        step = tl.load(total_ptr + slot, mask=active, other=0).to(tl.int64) - tl.load(
            prompt_ptr + slot, mask=active, other=0
        ).to(tl.int64)
        active = active & (n > 0) & (step >= 0) & (step < n)
        token = tl.load(table_ptr + slot * row_stride + step, mask=active, other=0)
        tl.store(out_ptr + rows, token, mask=active)

    rows = setup.cfg["batch"]
    st = setup.state
    block = 256

    def run(tables, sampled, idx, total, prompt):
        return jt.triton_call(
            sampled,
            idx,
            total,
            prompt,
            tables.table,
            tables.trace_len,
            rows,
            st.max_slots,
            st.max_trace_len,
            kernel=replay_out,
            out_shape=jax.ShapeDtypeStruct(sampled.shape, sampled.dtype),
            grid=((rows + block - 1) // block,),
            input_output_aliases={0: 0},
            num_warps=4,
            BLOCK=block,
        )

    return run


def make_replay(name, setup):
    import trace_replay_jax

    if name == "none":
        return lambda tables, sampled, idx, total, prompt: sampled
    if name == "trace_replay_jax":
        return trace_replay_jax.replay
    if name == "trace_replay_jax_kernel":
        return lambda tables, sampled, idx, total, prompt: trace_replay_jax.replay(
            tables, sampled, idx, total, prompt, method="kernel"
        )
    if name == "plain_jnp":
        return lambda tables, sampled, idx, total, prompt: plain_jnp_replay(*tables, sampled, idx, total, prompt)
    if name == "buffer_callback":
        return buffer_callback_replay(setup, command_buffer=False)
    if name == "buffer_callback_cmdbuf":
        return buffer_callback_replay(setup, command_buffer=True)
    if name == "jax_triton":
        return jax_triton_replay(setup)
    raise ValueError(name)


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


class Busy:
    """A jitted program that keeps the device busy for about ``target_us``, on data of its own.

    A ``lax.fori_loop`` (static trip count: no host round trip per iteration) of bf16 matmuls
    ``busy_size`` square; the trip count comes from timing ``busy_calib_iters`` iterations once."""

    def __init__(self, cfg, device, target_us):
        import jax
        import jax.numpy as jnp

        n = cfg["busy_size"]
        rng = np.random.default_rng(2)
        self.a, self.b = (
            jax.device_put((rng.standard_normal((n, n)) / np.sqrt(n)).astype(jnp.bfloat16), device) for _ in range(2)
        )

        def busy(a, b, iters):
            body = lambda i, x: jnp.dot(x, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # noqa: E731
            return jax.lax.fori_loop(0, iters, body, a)

        self.fn = jax.jit(busy, static_argnums=2)
        calib = cfg["busy_calib_iters"]
        self.iters = calib
        jax.block_until_ready(self())  # compile
        per_iter = min(self.time_us() for _ in range(3)) / calib
        self.iters = max(1, int(np.ceil(target_us / per_iter)))
        jax.block_until_ready(self())  # compile the final trip count
        self.target_us = target_us

    def __call__(self):
        return self.fn(self.a, self.b, self.iters)

    def time_us(self):
        t0 = time.perf_counter()
        self().block_until_ready()
        return (time.perf_counter() - t0) * 1e6


def enqueue_us(dispatch, args, setup, k):
    """Host time to dispatch ``k`` dependent steps (the device idle at the start), in us."""
    import jax

    x, total = setup.x0, setup.total0
    t0 = time.perf_counter()
    for _ in range(k):
        x, total, toks = dispatch(*args, x, total, setup.prompt, setup.idx)
    t1 = time.perf_counter()
    jax.block_until_ready(toks)
    return (t1 - t0) * 1e6


def queued_sample(busy, dispatch, args, setup, k):
    """One "dispatch_device" sample, in us: (T0 busy alone, T1 busy + ``k`` queued steps, host
    time to dispatch the busy program, host time to dispatch the ``k`` steps after it). The
    device is idle at the start."""
    import jax

    t_alone = busy.time_us()
    x, total = setup.x0, setup.total0
    t0 = time.perf_counter()
    out = busy()
    t1 = time.perf_counter()
    for _ in range(k):
        x, total, toks = dispatch(*args, x, total, setup.prompt, setup.idx)
    t2 = time.perf_counter()
    jax.block_until_ready((out, toks))
    t3 = time.perf_counter()
    return t_alone, (t3 - t0) * 1e6, (t1 - t0) * 1e6, (t2 - t1) * 1e6


def make_busy(cfg, device, runners, setup):
    """The busy program, sized to BUSY_HOST_FACTOR x the slowest host enqueue of queue_steps steps."""
    k = cfg["queue_steps"]
    host = max(np.median([enqueue_us(d, args, setup, k) for _ in range(3)]) for d, _, args, _ in runners.values())
    return Busy(cfg, device, max(cfg["busy_min_us"], BUSY_HOST_FACTOR * float(host))), float(host)


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


# -- eager host time ------------------------------------------------------------------------------
class _Handoff:
    """Hands one DLPack capsule on; makes the consumer's stream wait for ``event`` first."""

    __slots__ = ("capsule", "device", "producer_stream", "event", "cu")

    def __init__(self, capsule, device, producer_stream, event, cu):
        self.capsule, self.device, self.producer_stream, self.event, self.cu = (
            capsule,
            device,
            producer_stream,
            event,
            cu,
        )

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, **_):
        if stream is not None and stream not in (-1, self.producer_stream):
            self.cu.cuStreamWaitEvent(stream, self.event, 0)
        return self.capsule


class _DLPackCoreReplay:
    """The core's kernel reached eagerly over DLPack: a candidate, measured for comparison.

    ``sampled.__dlpack__(copy=True)`` gives a copy the consumer may write (DLPack's contract);
    the kernel replays into it on a side stream after the handshake; ``jax.dlpack.from_dlpack``
    takes it back, its ready-event stream waiting for the kernel through an event."""

    def __init__(self, setup):
        from cuda.bindings import driver as cu
        from cuda.core import Device

        self.cu = cu
        self.table = setup.state.table
        dev = Device(setup.state.device.local_hardware_id)
        dev.set_current()
        self.stream = dev.create_stream()
        self.handle = int(self.stream.handle)
        err, self.event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        assert err == cu.CUresult.CUDA_SUCCESS, err

    def __call__(self, sampled, idx, total, prompt):
        import jax

        capsule = sampled.__dlpack__(stream=self.handle, copy=True)
        out = _Handoff(capsule, sampled.__dlpack_device__(), self.handle, self.event, self.cu)
        self.table.replay(out, idx, total, prompt, stream=self.handle)
        self.cu.cuEventRecord(self.event, self.handle)
        return jax.dlpack.from_dlpack(out)


def eager_rows(cfg, setup, device):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    c = cfg
    sampled = jax.device_put(rng.integers(0, c["vocab"], c["batch"]).astype(np.int32), device)
    step = jax.device_put(
        (np.asarray(setup.total0) - np.asarray(setup.prompt))[np.maximum(np.asarray(setup.idx), 0)], device
    )
    args = (sampled, setup.idx, setup.total0, setup.prompt)
    st = setup.state
    want = np.asarray(st.replay(*args))
    # The floor of an eager call: one jitted dispatch of the same six arrays that only copies
    # ``sampled`` (one tiny kernel); it replays nothing, so its tokens are not compared.
    floor = jax.jit(lambda table, trace_len, s, i, t, p: s ^ jnp.int32(0) + (i[:1] * 0).sum())
    candidates = {
        "trace_replay_jax": lambda: st.replay(*args),
        "trace_replay_jax_at_step": lambda: st.replay_at_step(sampled, setup.idx, step),
        "trace_replay_jax_kernel": lambda: st.replay(*args, method="kernel"),
        "trace_replay_jax_kernel_at_step": lambda: st.replay_at_step(sampled, setup.idx, step, method="kernel"),
        "jit_dispatch_floor": lambda: floor(st.tables.table, st.tables.trace_len, *args),
    }
    if device.platform == "gpu":
        factories = (
            ("dlpack_core_kernel", lambda: _DLPackCoreReplay(setup)),
            ("buffer_callback", lambda: jax.jit(buffer_callback_replay(setup, command_buffer=False))),
        )
        for name, factory in factories:
            try:
                fn = factory()
                candidates[name] = (
                    (lambda fn=fn: fn(*args)) if name == "dlpack_core_kernel" else (lambda fn=fn: fn(st.tables, *args))
                )
            except Exception as exc:  # noqa: BLE001
                print(f"eager candidate {name} failed: {exc}", flush=True)
    rows = []
    samples = {n: [] for n in candidates}
    results = {}
    for name, fn in candidates.items():
        try:
            results[name] = np.asarray(fn())
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(config="default", mechanism=name, mode="eager_host", error=f"{type(exc).__name__}: {exc}"))
            samples.pop(name)
    for _ in range(c["rounds"]):
        for name in samples:
            fn = candidates[name]
            for _ in range(20):
                out = fn()
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(c["eager_calls"]):
                out = fn()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            samples[name].append((t1 - t0) / c["eager_calls"] * 1e6)
    for name, s in samples.items():
        match = None if name == "jit_dispatch_floor" else bool(np.array_equal(results[name], want))
        rows.append(
            dict(
                config="default",
                mechanism=name,
                mode="eager_host",
                steps_per_call=1,
                tokens_match=match,
                **percentiles(s),
            )
        )
    return rows


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU is fine, writes nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--mechanisms", help=argparse.SUPPRESS)
    ap.add_argument("--process", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=240.0, help="seconds per child process")
    a = ap.parse_args()
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
        if "us_p50" in r:
            queued = ""
            if r["mode"] == "dispatch_device":
                queued = (
                    f"  busy {r['busy_us_p50']:.0f} us, enqueue max {r['enqueue_us_max']:.0f} us, "
                    f"host_hidden={r['host_hidden']} ({r['rounds_hidden']}/{r['rounds']} rounds)"
                    + (" (smoke)" if r.get("smoke") else "")
                    + ("" if r["host_hidden"] else "  WARNING: host not hidden, not device time")
                )
            print(
                f"{r['config']:16s} {r['process']:10s} {r['mechanism']:26s} {r['mode']:15s} "
                f"p50 {r['us_p50']:9.2f} us/step (p20 {r['us_p20']:.2f}, p80 {r['us_p80']:.2f})  "
                f"added {r.get('added_us_p50', float('nan')):7.2f}  tokens_match={r.get('tokens_match')}{queued}",
                flush=True,
            )
        else:
            print(
                f"{r['config']:16s} {r.get('process')} {r['mechanism']:26s} {r['mode']:15s} ERROR {r.get('error')}",
                flush=True,
            )
    if a.smoke:
        return
    from harness import write_results

    shape = {k: FULL[k] for k in ("batch", "hidden", "layers", "vocab", "max_slots", "max_trace_len", "loop_steps")}
    print("wrote", write_results("jax_step", [dict(r, **shape) for r in rows]))


if __name__ == "__main__":
    main()
