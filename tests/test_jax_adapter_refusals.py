"""The JAX adapter's refusals: a table of id -> (call, exception, anchored message), each
checked to change nothing; and a CUDA device asked for where there is none, refused with the
fix. CPU tier (the GPU tier's refusals are in ``test_gpu_jax_adapter.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jax_adapter_cases import POISON, VOCAB

import trace_replay_jax as trj
from trace_replay_jax import TraceReplayState

# Each case keeps a write staged, not applied, on purpose (to show that a refusal leaves it so)
# and reads state.tables meanwhile: the StagedWritesWarning that read gives is expected here.
pytestmark = pytest.mark.filterwarnings("ignore::trace_replay_core.StagedWritesWarning")

I32 = jnp.int32


def _args(n=4):
    return (jnp.full(n, POISON, I32), jnp.array([1, 2, -1, 1][:n], I32), jnp.arange(8, dtype=I32), jnp.zeros(8, I32))


# ``_args()`` as numpy arrays, made here: constants inside a traced function (jnp arrays made
# inside one may be traced).
CONSTS = tuple(np.asarray(a) for a in _args())


# Errors raised while JAX traces the caller's function (jit, vmap) carry JAX's traceback note
# after the message, so those patterns are anchored at the start only.
REFUSALS = {
    "sampled-float": (
        lambda st: st.replay(_args()[0].astype(jnp.float32), *_args()[1:]),
        TypeError,
        r"^sampled must have dtype int32 or int64 \(got float32\); replay overwrites integer token ids "
        r"and has no gradient: apply it to the sampler's token ids, outside jax\.grad$",
    ),
    "sampled-speculative": (
        lambda st: st.replay(jnp.zeros((4, 2), I32), *_args()[1:]),
        ValueError,
        r"^sampled has 2 tokens per row \(shape \[4, 2\]\): speculative decoding is not "
        r"supported; replay takes exactly one token per request per step$",
    ),
    "sampled-3d": (
        lambda st: st.replay(jnp.zeros((4, 1, 1), I32), *_args()[1:]),
        ValueError,
        r"^sampled must be 1-D \[batch\] or \[batch, 1\] \(got shape \[4, 1, 1\]\)$",
    ),
    "sampled-list": (
        lambda st: st.replay([1, 2, 3, 4], *_args()[1:]),
        TypeError,
        r"^sampled must be a JAX or numpy array \(got list\)$",
    ),
    "idx-float": (
        lambda st: st.replay(_args()[0], _args()[1].astype(jnp.float32), *_args()[2:]),
        TypeError,
        r"^idx_mapping must have dtype int32 or int64 \(got float32\)$",
    ),
    "idx-length": (
        lambda st: st.replay(_args()[0], _args()[1][:3], *_args()[2:]),
        ValueError,
        r"^idx_mapping must be 1-D with 4 rows like sampled \(got shape \[3\]\)$",
    ),
    "total-short": (
        lambda st: st.replay(*_args()[:2], jnp.zeros(5, I32), _args()[3]),
        ValueError,
        r"^total_len must be 1-D with at least max_slots=8 entries \(got shape \[5\]\)$",
    ),
    "prompt-int16": (
        lambda st: st.replay(*_args()[:3], jnp.zeros(8, jnp.int16)),
        TypeError,
        r"^prompt_len must have dtype int32 or int64 \(got int16\)$",
    ),
    "step-length": (
        lambda st: st.replay_at_step(*_args()[:2], jnp.zeros(2, I32)),
        ValueError,
        r"^step must be 1-D with 4 rows like sampled \(got shape \[2\]\)$",
    ),
    "tables-type": (
        lambda st: trj.replay((st.tables.table, st.tables.trace_len), *_args()),  # type: ignore[arg-type]
        TypeError,
        r"^tables must be a ReplayTables \(state\.tables\) \(got tuple\)$",
    ),
    "vmap-state": (
        lambda st: jax.vmap(lambda s: st.replay(s, *_args()[1:]))(_args()[0][None]),
        ValueError,
        r"^trace_replay_jax\.replay does not support jax\.vmap: it already replays a whole batch\. Call "
        r"it on the batched arrays instead .*without vmap",
    ),
    "vmap-function": (
        lambda st: jax.jit(jax.vmap(trj.replay, in_axes=(None, 0, 0, None, None)))(
            st.tables, _args()[0][None], _args()[1][None], *_args()[2:]
        ),
        ValueError,
        r"^trace_replay_jax\.replay does not support jax\.vmap",
    ),
    "state-replay-in-jit": (
        lambda st: jax.jit(lambda s: st.replay(s, *_args()[1:]))(_args()[0]),
        ValueError,
        r"^state\.replay\(\) cannot be used inside jax\.jit, lax loops or other transformations "
        r"\(got traced arrays\): pass state\.tables into the jitted function as an argument and "
        r"call trace_replay_jax\.replay\(tables, \.\.\.\) there",
    ),
    "tables-closed-over-in-jit": (
        lambda st: jax.jit(lambda s: trj.replay(st.tables, s, *_args()[1:]))(_args()[0]),
        ValueError,
        r"^tables must be passed into the jitted function as an argument "
        r"\(got a concrete array while sampled/idx_mapping are traced\)",
    ),
    # Every replay argument a constant (#39): nothing is traced, yet the call is traced into the
    # caller's program with the table as a constant, replaying this moment's traces forever.
    "tables-closed-over-constant-args": (
        lambda st: jax.jit(lambda: trj.replay(st.tables, *CONSTS))(),
        ValueError,
        r"^tables must be passed into the jitted function as an argument \(got a concrete array "
        r"while JAX traces the function that calls replay\): a closed-over table is compiled in as a "
        r"constant and would miss later apply_staged_writes\(\)",
    ),
    "tables-closed-over-constant-args-kernel": (
        lambda st: jax.jit(lambda: trj.replay(st.tables, *CONSTS, method="kernel"))(),
        ValueError,
        r"^tables must be passed into the jitted function as an argument \(got a concrete array while JAX traces",
    ),
    "tables-closed-over-constant-args-at-step": (
        lambda st: jax.jit(lambda: trj.replay_at_step(st.tables, CONSTS[0], CONSTS[1], np.zeros(4, np.int32)))(),
        ValueError,
        r"^tables must be passed into the jitted function as an argument \(got a concrete array while JAX traces",
    ),
    "tables-closed-over-in-a-loop": (
        lambda st: jax.lax.fori_loop(0, 2, lambda k, c: trj.replay(st.tables, *CONSTS), CONSTS[0]),
        ValueError,
        r"^tables must be passed into the jitted function as an argument \(got a concrete array while JAX traces",
    ),
    "state-replay-in-jit-constant-args": (
        lambda st: jax.jit(lambda: st.replay(*CONSTS))(),
        ValueError,
        r"^state\.replay\(\) cannot be used inside jax\.jit, lax loops or other transformations \(it "
        r"was called while JAX traced a function, with constant arguments: the table would be compiled "
        r"in as a constant and miss later apply_staged_writes\(\)\): pass state\.tables into the jitted "
        r"function as an argument and call trace_replay_jax\.replay\(tables, \.\.\.\) there",
    ),
    "state-replay-at-step-in-jit-constant-args": (
        lambda st: jax.jit(lambda: st.replay_at_step(CONSTS[0], CONSTS[1], np.zeros(4, np.int32)))(),
        ValueError,
        r"^state\.replay_at_step\(\) cannot be used inside jax\.jit, lax loops or other transformations \(it "
        r"was called while JAX traced a function, with constant arguments",
    ),
    "trace-too-long": (
        lambda st: st.add_request(0, list(range(9))),
        ValueError,
        r"^tokens has 9 tokens; the table holds at most max_trace_len=8$",
    ),
    "trace-above-vocab": (
        lambda st: st.add_request(0, [VOCAB]),
        ValueError,
        r"^tokens must be below vocab_size=50000 \(got 50000 at index 0\)$",
    ),
    "trace-negative": (
        lambda st: st.add_request(0, [1, -2]),
        ValueError,
        r"^tokens must be non-negative \(got -2 at index 1\)$",
    ),
    "trace-traced": (
        lambda st: jax.jit(lambda tr: st.add_request(0, tr))(jnp.ones(2, I32)),
        TypeError,
        r"^trace must be concrete host data; add_request\(\) is host-only",
    ),
    "slot-out-of-range": (lambda st: st.add_request(8, [1]), ValueError, r"^slot must be in \[0, 8\) \(got 8\)$"),
    "device-string": (
        lambda st: TraceReplayState(2, 2, device="tpu"),
        ValueError,
        r"^device must be a jax\.Device, 'cpu', 'cuda', 'cuda:N' or None \(got 'tpu'\)$",
    ),
    "device-type": (
        lambda st: TraceReplayState(2, 2, device=3.0),
        TypeError,
        r"^device must be a jax\.Device, 'cpu', 'cuda', 'cuda:N' or None \(got float\)$",
    ),
    "max-slots": (
        lambda st: TraceReplayState(0, 2, device="cpu"),
        ValueError,
        r"^max_slots must be between 1 and \d+ \(got 0\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_change_nothing(case):
    call, exc, pattern = REFUSALS[case]
    with TraceReplayState(8, 8, device="cpu", vocab_size=VOCAB) as state:
        state.add_request(1, [5, 6, 7])
        state.apply_staged_writes()
        state.add_request(2, [8, 9, 10])  # staged, not applied
        tables = state.tables
        before = [np.asarray(x).copy() for x in (tables.table, tables.trace_len)]
        with pytest.raises(exc, match=pattern):
            call(state)
        assert state.pending == 1
        assert state.tables is tables
        for x, b in zip((tables.table, tables.trace_len), before):
            np.testing.assert_array_equal(np.asarray(x), b)
        out = state.replay(*_args())
        assert np.asarray(out).tolist() == [6, POISON, POISON, 6]  # slot 1 at step 1; slot 2 not applied
        state.apply_staged_writes()
        assert np.asarray(state.replay(*_args())).tolist() == [6, 10, POISON, 6]


def test_cuda_device_without_a_gpu_is_refused_with_the_fix():
    try:
        jax.devices("gpu")
        pytest.skip("this machine has a GPU")
    except RuntimeError:
        pass
    with pytest.raises(
        ValueError,
        match=r"^device 'cuda' is not available: JAX has no gpu backend here .*; "
        r"use device='cpu'$",
    ):
        TraceReplayState(2, 2, device="cuda")
