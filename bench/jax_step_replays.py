"""The replay mechanisms ``jax_step.py`` compares, the step's inputs, and the eager candidates.

Each mechanism is a function ``replay(tables, sampled, idx, total, prompt) -> tokens`` that a
jitted decode step calls (:func:`make_replay`); :class:`Setup` holds the weights, inputs and a
filled ``TraceReplayState``; :func:`eager_rows` times one eager replay call per candidate.
"""

from __future__ import annotations

import time

import numpy as np
from harness import percentiles


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
