"""Which device a JAX state lives on, and a replay argument on another device: cases run by
``test_jax_devices.py`` in a process of its own with 2 CPU host devices (JAX fixes its CPU device
count when it starts). Run them directly with::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m pytest -q -p no:cacheprovider tests/jax_device_cases.py

Before: ``TraceReplayState(device=None)`` took ``jax.devices()[0]`` whatever
``jax.default_device(...)`` or the ``jax_default_device`` setting said, and an argument on
another device failed with JAX's ``Received incompatible devices ... _jit_slots.<locals>.<lambda>``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.backend import get_default_device

import trace_replay_jax as trj

I32 = jnp.int32
CPU0, CPU1 = jax.devices("cpu")[:2] if len(jax.devices("cpu")) >= 2 else (None, None)
pytestmark = pytest.mark.skipif(CPU1 is None, reason="needs 2 CPU host devices (run by test_jax_devices.py)")


def _state(**kw):
    state = trj.TraceReplayState(4, 8, **kw)
    state.add_request(1, [40, 41, 42])
    state.apply_staged_writes()
    return state


def _args(device=None):
    args = (jnp.array([7, 8], I32), jnp.array([1, 3], I32), jnp.array([0, 6, 0, 0], I32), jnp.array([0, 5, 0, 0], I32))
    return args if device is None else tuple(jax.device_put(a, device) for a in args)


def test_device_none_follows_jax_default_device_context():
    with jax.default_device(CPU1):
        with _state() as state:
            assert state.device == CPU1 and state.tables.table.devices() == {CPU1}
            assert state.replay(*_args(CPU1)).tolist() == [41, 8]
            assert state.replay(*_args()).tolist() == [41, 8]  # made under the same default: on CPU1
    with _state() as state:
        assert state.device == get_default_device() == CPU0


def test_device_none_follows_the_jax_default_device_setting():
    before = jax.config.jax_default_device
    try:
        jax.config.update("jax_default_device", CPU1)
        with _state() as state:
            assert state.device == CPU1
        jax.config.update("jax_default_device", "cpu")  # a platform name: its first device
        with _state() as state:
            assert state.device == CPU0
    finally:
        jax.config.update("jax_default_device", before)


def test_an_explicit_device_wins_over_the_default():
    with jax.default_device(CPU1):
        with _state(device=CPU0) as state:
            assert state.device == CPU0


MISMATCH = (
    r"^{name} is on cpu:1 but the state's tables are on cpu:0: put {name} on the state's device "
    r"\(jax\.device_put\({name}, state\.device\)\) or create the state on {name}'s "
    r"\(TraceReplayState\(device=\.\.\.\); device=None takes JAX's default device, "
    r"jax\.default_device\(\.\.\.\) included\)$"
)


@pytest.mark.parametrize("method", ["jnp", "kernel"])
@pytest.mark.parametrize("moved", [0, 1, 2, 3])
def test_an_argument_on_another_device_is_named_with_both_devices(method, moved):
    names = ("sampled", "idx_mapping", "total_len", "prompt_len")
    with _state(device=CPU0) as state:
        args = list(_args(CPU0))
        args[moved] = jax.device_put(args[moved], CPU1)
        tables = state.tables
        with pytest.raises(ValueError, match=MISMATCH.format(name=names[moved])):
            state.replay(*args, method=method)
        with pytest.raises(ValueError, match=MISMATCH.format(name=names[moved])):
            trj.replay(state.tables, *args, method=method)
        assert state.tables is tables  # a rejected call changes nothing
        assert state.replay(*_args(CPU0), method=method).tolist() == [41, 8]


def test_a_step_on_another_device_is_named():
    with _state(device=CPU0) as state:
        sampled, idx = _args(CPU0)[:2]
        step = jax.device_put(jnp.array([1, 0], I32), CPU1)
        with pytest.raises(ValueError, match=MISMATCH.format(name="step")):
            state.replay_at_step(sampled, idx, step)
        with pytest.raises(ValueError, match=MISMATCH.format(name="step")):
            trj.replay_at_step(state.tables, sampled, idx, step)


def test_other_errors_are_not_reported_as_a_device_mismatch():
    with _state(device=CPU0) as state:
        with pytest.raises(ValueError, match=r"^idx_mapping must be 1-D with 2 rows like sampled"):
            state.replay(_args(CPU0)[0], jax.device_put(jnp.array([1], I32), CPU1), *_args(CPU0)[2:])
        np.testing.assert_array_equal(state.replay(*_args(CPU0)), [41, 8])
