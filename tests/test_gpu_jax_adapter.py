"""The JAX adapter on a GPU: zero-copy tables, commits ordered on XLA's stream behind queued
programs without a host sync, many steps behind a slow kernel, the torch adapter in the same
process, parity with command buffers forced on (in a subprocess), and the logprob kernel's
``argmax=True`` (greedy rows, batch invariance, inside a fori loop) and ``entropy=True``.
Skipped without a GPU.

The CPU tier of the same adapter (semantics, ownership, ordering, refusals) is
``test_jax_adapter.py``, whose helpers these tests share.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jax_adapter_cases import POISON, REPO, VOCAB, _one_row_step  # noqa: E402
from helpers.jax_helpers import jax_gpu  # noqa: E402

import trace_replay_jax as trj  # noqa: E402
from trace_replay_jax import TraceReplayState  # noqa: E402


def _slow_gpu_fn(device, seconds=0.5):
    """A jitted fn(x) -> x-dependent int32 zeros that keeps the GPU busy for about ``seconds``.

    Python-unrolled matmuls (no loop: a device-side loop might sync inside XLA)."""
    x = jax.device_put(jnp.ones((8192, 8192), jnp.float32) / 8192, device)

    def make(k):
        def f(x):
            for _ in range(k):
                x = jnp.tanh(jnp.dot(x, x, precision=jax.lax.Precision.HIGHEST))
            return x

        return jax.jit(f)

    probe = make(4)
    probe(x).block_until_ready()
    t0 = time.perf_counter()
    probe(x).block_until_ready()
    per = (time.perf_counter() - t0) / 4
    k = int(min(400, max(4, seconds / max(per, 1e-6))))
    slow = make(k)
    slow(x).block_until_ready()
    t0 = time.perf_counter()
    slow(x).block_until_ready()
    return slow, x, time.perf_counter() - t0


@jax.jit
def _dep_zero(slow_out):
    return (slow_out[0, :1] * 0).astype(jnp.int32)


def _dep_tokens(slow_out, values, device):
    """int32 tokens equal to ``values`` that JAX can only compute after ``slow_out`` (one program)."""
    return _dep_zero(slow_out) + jax.device_put(np.asarray(values, np.int32), device)


@pytest.mark.gpu
def test_gpu_trace_data_on_the_gpu_is_refused_with_the_fix():
    gpu = jax_gpu()
    on_gpu = jax.device_put(np.arange(1, 7, dtype=np.int32).reshape(2, 3), gpu)
    with TraceReplayState(4, 8, device=gpu) as state:
        with pytest.raises(ValueError, match=r"^trace must be host data .*: pass np\.asarray\(trace\) \(a device"):
            state.add_request(0, on_gpu[0])
        with pytest.raises(ValueError, match=r"^traces must be host data .*: pass np\.asarray\(traces\)"):
            state.add_requests([0, 1], on_gpu)
        with pytest.raises(ValueError, match=r"^traces\[1\] must be host data .*: pass np\.asarray\(traces\[1\]\)"):
            state.add_requests([0, 1], [[1], on_gpu[1]])
        assert state.pending == 0
        state.add_requests([0, 1], np.asarray(on_gpu))
        assert state.pending == 2


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_gpu_tables_are_zero_copy_views_of_the_core_table(placement, rng):
    gpu = jax_gpu()
    with TraceReplayState(16, 64, device=gpu, placement=placement) as state:
        table_view, lengths_view = state.table.device_views()
        assert state.tables.table.unsafe_buffer_pointer() == table_view.ptr
        assert state.tables.trace_len.unsafe_buffer_pointer() == lengths_view.ptr
        assert state.tables.table.devices() == {gpu}
        tr = rng.integers(0, VOCAB, 64)
        state.add_request(5, tr)
        state.apply_staged_writes()
        table, lens = state.snapshot()
        np.testing.assert_array_equal(np.asarray(state.tables.table), table)
        np.testing.assert_array_equal(np.asarray(state.tables.trace_len), lens)
        assert lens[5] == 64 and (table[5] == tr).all()
        views = state.tables
    assert views.table.is_deleted() and views.trace_len.is_deleted()


@pytest.mark.gpu
def test_gpu_apply_is_ordered_behind_queued_programs_without_host_sync(rng):
    """Write-after-read and read-after-write across apply_staged_writes(), all queued behind
    a slow kernel: a commit that ran early (another stream, or the host) would make the first
    replay read the new trace; a host sync would make the slow kernel finish first."""
    gpu = jax_gpu()
    slow, x, seconds = _slow_gpu_fn(gpu)
    a, b = rng.integers(0, VOCAB, 16), rng.integers(0, VOCAB, 16)
    step = int(rng.integers(0, 16))
    jitted = jax.jit(lambda t, s, i, tl, pl: trj.replay(t, s, i, tl, pl))
    with TraceReplayState(8, 16, device=gpu) as state:
        state.add_request(3, a)
        state.apply_staged_writes()
        idx = jax.device_put(np.array([3, -1, 3], np.int32), gpu)
        total = np.zeros(8, np.int32)
        total[3] = step
        tl, pl = jax.device_put(total, gpu), jax.device_put(np.zeros(8, np.int32), gpu)
        warm = _dep_tokens(x, [0, 0, 0], gpu)  # compile everything first
        jax.block_until_ready((state.replay(warm, idx, tl, pl), jitted(state.tables, warm, idx, tl, pl)))
        t0 = time.perf_counter()
        busy = slow(x)
        sampled = _dep_tokens(busy, [POISON] * 3, gpu)
        first = state.replay(sampled, idx, tl, pl)  # reads the table after the slow kernel
        first_jit = jitted(state.tables, sampled, idx, tl, pl)
        state.add_request(3, b)
        state.apply_staged_writes()  # must land after the two replays
        second = state.replay(sampled, idx, tl, pl)
        second_jit = jitted(state.tables, sampled, idx, tl, pl)
        queued = time.perf_counter() - t0
        assert not busy.is_ready(), f"something waited for the device ({queued:.3f} s vs {seconds:.3f} s)"
        assert np.asarray(first).tolist() == [a[step], POISON, a[step]]
        assert np.asarray(first_jit).tolist() == [a[step], POISON, a[step]]
        assert np.asarray(second).tolist() == [b[step], POISON, b[step]]
        assert np.asarray(second_jit).tolist() == [b[step], POISON, b[step]]


@pytest.mark.gpu
def test_gpu_many_steps_queue_behind_a_slow_kernel(rng):
    """Steps (eager and jitted, fresh buffers each) and an apply, all queued behind a slow
    kernel, return before it finishes. JAX itself lets at most 32 programs per device run
    ahead of the GPU (XLA's max_inflight_computations), so the test stays below that."""
    gpu = jax_gpu()
    slow, x, seconds = _slow_gpu_fn(gpu, seconds=1.0)
    tr = rng.integers(0, VOCAB, 300)
    steps = 12  # 2 programs per step + 4 others < 32
    with TraceReplayState(4, 300, device=gpu) as state:
        state.add_request(2, tr)
        state.apply_staged_writes()

        @jax.jit
        def step(tables, sampled, idx, total, prompt):
            out = trj.replay(tables, sampled, idx, total, prompt)
            return out, total.at[jnp.where(idx >= 0, idx, total.shape[0])].add(1, mode="drop")

        idx = jax.device_put(np.array([2, -1], np.int32), gpu)
        total = jax.device_put(np.zeros(4, np.int32), gpu)
        prompt = jax.device_put(np.zeros(4, np.int32), gpu)
        warm = _dep_tokens(x, [0, 0], gpu)  # compile everything first
        jax.block_until_ready((state.replay(warm, idx, total, prompt), step(state.tables, warm, idx, total, prompt)))
        t0 = time.perf_counter()
        busy = slow(x)
        sampled = _dep_tokens(busy, [POISON, POISON], gpu)
        outs = []
        for k in range(steps):
            outs.append(state.replay(sampled, idx, total, prompt))
            out, total = step(state.tables, sampled, idx, total, prompt)  # a new total buffer each step
            outs.append(out)
            if k == steps // 2:
                state.add_request(1, [7])  # an apply in the middle, queued as well
                state.apply_staged_writes()
        queued = time.perf_counter() - t0
        assert not busy.is_ready(), f"a step waited for the device ({queued:.3f} s vs {seconds:.3f} s)"
        got = np.stack([np.asarray(o) for o in outs])
        want = np.array([[tr[k // 2], POISON] for k in range(2 * steps)])
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_gpu_commit_runs_on_xlas_stream():
    from jax.experimental.buffer_callback import buffer_callback

    gpu = jax_gpu()
    seen = []
    probe = jax.jit(
        buffer_callback(
            lambda ctx, out, x: seen.append(int(ctx.stream)), jax.ShapeDtypeStruct((), np.int32), has_side_effect=True
        )
    )
    with TraceReplayState(4, 4, device=gpu) as state:
        probe(state.tables.trace_len).block_until_ready()
        streams = []
        original = state.table.commit

        def recording(*, stream):
            streams.append(stream)
            original(stream=stream)

        state.table.commit = recording
        state.add_request(0, [1, 2])
        state.apply_staged_writes()
        state.add_request(1, [3])  # waits until the commit op has run
        assert streams == seen and seen[0] != 0


@pytest.mark.gpu
def test_gpu_torch_adapter_in_the_same_process(rng):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from trace_replay_torch import TraceReplayState as TorchState

    gpu = jax_gpu()
    env = dict(os.environ)
    tr = rng.integers(0, VOCAB, 8)
    with TraceReplayState(4, 8, device=gpu) as jstate:
        jstate.add_request(1, tr)
        jstate.apply_staged_writes()
        jout = jstate.replay(*_one_row_step(jstate, 1, 5, gpu))
        dev = f"cuda:{gpu.local_hardware_id}"
        with TorchState(4, 8, device=dev) as tstate:
            tstate.add_request(1, tr)
            tstate.apply_staged_writes()
            s = torch.full((1,), POISON, dtype=torch.int64, device=dev)
            total = torch.zeros(4, dtype=torch.int32, device=dev)
            total[1] = 5
            tstate.replay(
                s,
                torch.tensor([1], dtype=torch.int32, device=dev),
                total,
                torch.zeros(4, dtype=torch.int32, device=dev),
            )
            assert s.item() == tr[5]
        assert int(jout[0]) == tr[5]
    assert "jax_triton" not in sys.modules
    assert dict(os.environ) == env


@pytest.mark.gpu
def test_gpu_parity_with_command_buffers_in_a_subprocess():
    """XLA command buffers for custom calls, loops and conditionals: replay still reads the
    table as committed between calls (the fori loop is one recorded graph)."""
    jax_gpu()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,"
        "CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
    ).strip()
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "test_parity.py"), "gpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parity ok" in proc.stdout


@pytest.mark.gpu
def test_gpu_kernel_argmax_vocab_151936_greedy_rows_batch_invariant():
    """token_logprob_rank(argmax=True) at vocab 151,936 bf16, batches 1 and 257, greedy (-1) and
    explicit rows mixed: the argmax is jnp.argmax's (rows without NaN), a greedy row has the bits
    of a call passing its argmax id, and a row has the same bits alone as in the batch of 257."""
    from helpers.argmax_cases import assert_greedy
    from helpers.logprob_cases import make_case

    gpu = jax_gpu()
    x, ids = make_case(np.random.default_rng(257), 257, 151936, "bfloat16")  # ties, -inf; no NaN
    ids[1::2] = -1
    logits = jax.device_put(jnp.asarray(x).astype(jnp.bfloat16), gpu)
    ids_j = jax.device_put(jnp.asarray(ids, jnp.int32), gpu)
    lp, rk, am = trj.token_logprob_rank(logits, ids_j, argmax=True)
    assert_greedy(x, ids, lp, rk, am, "gpu 257x151936 bf16")
    assert np.array_equal(np.asarray(am), np.asarray(jnp.argmax(logits, axis=1)))
    explicit = trj.token_logprob_rank(logits, jnp.where(ids_j < 0, am, ids_j))
    assert np.array_equal(np.asarray(explicit.logprobs).view(np.uint32), np.asarray(lp).view(np.uint32))
    assert np.array_equal(np.asarray(explicit.ranks), np.asarray(rk))
    for r in (0, 1, 2, 3, 4, 5, 128, 255, 256):
        one = trj.token_logprob_rank(logits[r : r + 1], ids_j[r : r + 1], argmax=True)
        got = (np.asarray(one.logprobs).view(np.uint32)[0], int(one.ranks[0]), int(one.argmax[0]))
        assert got == (np.asarray(lp).view(np.uint32)[r], int(rk[r]), int(am[r])), r


@pytest.mark.gpu
def test_gpu_kernel_argmax_inside_a_jitted_fori_loop_equals_eager_calls():
    """8 steps of greedy and explicit rows in one jitted lax.fori_loop (one compiled program,
    the callback's buffers bound once) give the bits of 8 eager calls."""
    gpu = jax_gpu()
    rng = np.random.default_rng(8)
    steps, batch, vocab = 8, 5, 151936
    xs = jax.device_put(
        jnp.asarray(rng.standard_normal((steps, batch, vocab), dtype=np.float32) * 3).astype(jnp.bfloat16), gpu
    )
    ids = rng.integers(0, vocab, size=(steps, batch)).astype(np.int32)
    ids[:, ::2] = -1
    ids = jax.device_put(jnp.asarray(ids), gpu)

    @jax.jit
    def loop(xs, ids):
        def body(k, acc):
            res = trj.token_logprob_rank(xs[k], ids[k], argmax=True)
            return tuple(a.at[k].set(v) for a, v in zip(acc, res))

        init = (
            jnp.zeros((steps, batch), jnp.float32),
            jnp.zeros((steps, batch), jnp.int32),
            jnp.zeros((steps, batch), jnp.int32),
        )
        return jax.lax.fori_loop(0, steps, body, init)

    lp, rk, am = loop(xs, ids)
    for k in range(steps):
        want = trj.token_logprob_rank(xs[k], ids[k], argmax=True)
        assert np.array_equal(np.asarray(want.logprobs).view(np.uint32), np.asarray(lp[k]).view(np.uint32)), k
        assert np.array_equal(np.asarray(want.ranks), np.asarray(rk[k])), k
        assert np.array_equal(np.asarray(want.argmax), np.asarray(am[k])), k
        assert np.array_equal(np.asarray(am[k]), np.asarray(jnp.argmax(xs[k], axis=1))), k


@pytest.mark.gpu
def test_gpu_kernel_entropy_vocab_151936_batch_invariant_and_inside_jit():
    """token_logprob_rank(entropy=True) at vocab 151,936 bf16, batch 257 (the kernel method on
    XLA's stream): the float64 reference's entropies, the jnp method's to the tolerance, the same
    bits for a row alone and inside a jitted function."""
    from helpers.entropy_cases import assert_entropy, entropy_case

    gpu = jax_gpu()
    x, ids = entropy_case(np.random.default_rng(258), 257, 151936, "bfloat16")
    logits = jax.device_put(jnp.asarray(x).astype(jnp.bfloat16), gpu)
    ids_j = jax.device_put(jnp.asarray(ids, jnp.int32), gpu)
    res = trj.token_logprob_rank(logits, ids_j, entropy=True)
    ent = np.asarray(res.entropy)
    assert_entropy(x, ent, "gpu jax kernel 257x151936 bf16", planted=True)
    assert_entropy(x, np.asarray(trj.token_logprob_rank(logits, ids_j, method="jnp", entropy=True).entropy), "jnp")
    jitted = jax.jit(lambda a, b: trj.token_logprob_rank(a, b, entropy=True, argmax=True).entropy)
    assert np.asarray(jitted(logits, ids_j)).tobytes() == ent.tobytes()
    for r in (0, 1, 2, 3, 128, 256):
        one = trj.token_logprob_rank(logits[r : r + 1], ids_j[r : r + 1], entropy=True)
        assert np.asarray(one.entropy).tobytes() == ent[r : r + 1].tobytes(), r
