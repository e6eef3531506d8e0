"""Memory follows the work: a decode run sizes its slots by ``min(max_batch, requests)`` and its
buffers by the requests' real lengths, and refuses, before allocating, a run whose estimate
exceeds the device's free memory (``DeviceMemoryError``), in both drivers (CPU tier; the free
memory of the CPU is simulated by replacing the drivers' ``free_bytes``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trace_replay_app.drivers import jax_driver, torch_driver  # noqa: E402
from trace_replay_app.models.gpt2 import GPT2Config, seeded_weights  # noqa: E402
from trace_replay_app.models.gpt2 import jax_loop as gpt2_jax  # noqa: E402
from trace_replay_app.models.gpt2 import torch_loop as gpt2_torch  # noqa: E402
from trace_replay_app.records import DeviceMemoryError, TraceRequest  # noqa: E402
from trace_replay_app.schedule import plan  # noqa: E402

CONFIG = GPT2Config(vocab_size=300, n_positions=96)
LOOPS = {"torch": (gpt2_torch.run_decode, torch_driver), "jax": (gpt2_jax.run_decode, jax_driver)}
HUGE = 100_000_000_000


def _requests(rng):
    out = []
    for i in range(4):
        prompt = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 9))))
        trace = tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 7))))
        out.append(TraceRequest(f"r{i}", prompt, trace) if i % 2 else TraceRequest(f"r{i}", prompt, max_new_tokens=5))
    return out


def test_schedule_slots_follow_the_requests():
    assert plan([3, 0, 2, 5], HUGE).slots == 3
    assert plan([3, 0, 2, 5], 2).slots == 2
    assert plan([], HUGE).slots == 1 and plan([], HUGE).n_steps == 0


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_a_huge_max_batch_runs_small_and_gives_the_same_results(framework, rng, monkeypatch):
    run, driver = LOOPS[framework]
    weights, requests = seeded_weights(CONFIG, seed=int(rng.integers(2**31))), _requests(rng)
    needed = []

    def report(device):  # what the run asks for, and plenty free
        return 2**60

    monkeypatch.setattr(driver, "free_bytes", report)
    real_check = driver.check_fits
    monkeypatch.setattr(driver, "check_fits", lambda dev, n, free: needed.append(n) or real_check(dev, n, free))
    start = time.perf_counter()
    huge = run(CONFIG, weights, requests, max_batch=HUGE)
    assert time.perf_counter() - start < 120
    exact = run(CONFIG, weights, requests, max_batch=len(requests))
    assert needed[0] == needed[1] < 2**26, needed  # the same estimate: the option does not count
    for a, b in zip(huge, exact, strict=True):
        for field in ("tokens", "forced", "logprobs", "ranks", "argmax"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (a.id, field)


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_a_run_that_does_not_fit_is_refused_before_allocating(framework, rng, monkeypatch):
    run, driver = LOOPS[framework]
    weights, requests = seeded_weights(CONFIG, seed=1), _requests(rng)
    started, steps = [], []
    monkeypatch.setattr(driver, "free_bytes", lambda device: 4096)
    monkeypatch.setattr(driver, "_decode_all", lambda *args, **kw: started.append(args))
    with pytest.raises(DeviceMemoryError) as info:
        run(CONFIG, weights, requests, max_batch=HUGE, on_step=steps.append)
    err = info.value
    assert err.device == "cpu" and err.free == 4096 and started == [] and steps == []
    weight_bytes = sum(w.size for w in weights.values()) * 4
    assert weight_bytes < err.needed < weight_bytes + 2**24, err.needed
    assert str(err).startswith(f"the decode run needs {err.needed / 2**20:,.1f} MiB on cpu, which has 0.0 MiB free")


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_the_estimate_follows_lengths_and_dtype(framework, rng, monkeypatch):
    run, driver = LOOPS[framework]
    weights = seeded_weights(CONFIG, seed=2)
    seen = []
    monkeypatch.setattr(driver, "free_bytes", lambda device: 0)

    def ask(requests, **kw):
        with pytest.raises(DeviceMemoryError) as info:
            run(CONFIG, weights, requests, max_batch=HUGE, **kw)
        seen.append(info.value.needed)

    short = [TraceRequest("a", (1, 2), (3, 4)), TraceRequest("b", (5,), max_new_tokens=2)]
    long = [TraceRequest("a", tuple(range(1, 60)), tuple(range(30))), TraceRequest("b", (5,), max_new_tokens=2)]
    ask(short)
    ask(long)
    ask(long, dtype="bfloat16")
    assert seen[0] < seen[1] and seen[2] < seen[1], seen
