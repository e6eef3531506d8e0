"""Device time of jitted JAX steps with the host hidden: a busy program, then queued steps.

``jax_step.py``'s "dispatch_device" mode. A jitted busy program (a ``lax.fori_loop`` of bf16
matmuls on its own data, sized once at start-up by :func:`make_busy` to 2.5x the host time of K
= ``queue_steps`` dispatches, at least ``busy_min_us``) is dispatched, then K dependent steps
queue behind it on the device's one stream (K stays below JAX's ~32 programs in flight); T1 =
busy + steps, dispatch to block; T0 = busy alone, same round (:func:`queued_sample`); device
time per step = (T1 - T0) / K. It includes what replay adds on the device (kernels, launch gaps
inside a program, a ``buffer_callback``'s Python if it runs while the device is busy), not the
host's dispatch cost. A round whose host dispatch of busy + K steps took longer than T0 timed
host gaps, not device time: ``jax_step.py`` drops it (``rounds_hidden`` of ``rounds`` are
kept) and marks the row ``host_hidden=False`` when fewer than half were kept.
"""

from __future__ import annotations

import time

import numpy as np

BUSY_HOST_FACTOR = 2.5  # the busy program lasts this many times the host time of queue_steps dispatches


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
