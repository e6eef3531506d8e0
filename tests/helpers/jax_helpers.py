"""Helpers shared by the JAX test modules ."""

from collections.abc import Sequence

import jax
import numpy as np
import pytest


def x64(enabled: bool = True):
    """Scoped x64 mode (int64 token ids in JAX); restores the previous setting."""
    scoped = getattr(jax, "enable_x64", None)
    if scoped is not None:
        return scoped(enabled)
    from jax.experimental import enable_x64  # before jax.enable_x64 existed

    return enable_x64(enabled)


def jax_gpu():
    """JAX's first GPU device. Where torch sees a CUDA GPU and JAX does not, JAX's CUDA build is
    missing or broken: the test fails (saying how to install it) rather than skip, since a
    skip would hide the GPU tier's JAX half; with no GPU at all, it skips with the reason."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as exc:
        import torch

        if torch.cuda.is_available():
            pytest.fail(
                f"torch sees a CUDA GPU but JAX does not ({exc}): install JAX's CUDA build "
                f"(pip install 'jax[cuda13]=={jax.__version__}')"
            )
        pytest.skip(f"no CUDA device visible to JAX ({exc})")


def external_view(ptr: int, shape: Sequence[int], dtype, device: jax.Device) -> jax.Array:
    """A ``jax.Array`` over compact row-major ``dtype`` data at ``ptr`` on ``device``, through the
    adapter's :func:`trace_replay_jax.views.jax_view` (what a state's GPU tables are made with),
    so that tests can check that view on memory of their own.

    ``ptr`` is a device pointer on a GPU, or a host pointer aligned to 64 bytes on the CPU; the
    caller keeps the memory alive and unwritten by others for as long as the view exists.
    """
    from trace_replay_core import ArrayView  # here: importing these helpers loads no library
    from trace_replay_jax.views import jax_view

    shape = tuple(int(s) for s in shape)
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    if device.platform == "cpu":
        kind, index = "cpu", 0
    else:
        kind, index = "cuda", int(device.local_hardware_id)
    return jax_view(ArrayView(ptr, shape, tuple(reversed(strides)), np.dtype(dtype).name, kind, index))
