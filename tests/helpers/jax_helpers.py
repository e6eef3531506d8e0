"""Helpers shared by the JAX test modules ."""

import jax
import pytest


def x64(enabled: bool = True):
    """Scoped x64 mode (int64 token ids in JAX); restores the previous setting."""
    scoped = getattr(jax, "enable_x64", None)
    if scoped is not None:
        return scoped(enabled)
    from jax.experimental import enable_x64  # before jax.enable_x64 existed

    return enable_x64(enabled)


def jax_gpu():
    """JAX's first GPU device, or skip the test with the reason."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"no CUDA device visible to JAX ({exc})")
