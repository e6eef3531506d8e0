"""The model registry: one :class:`Family` per model family (see :mod:`.family`).

Adding a family: write ``models/<name>/`` (``config.py`` numpy-only; ``torch_loop.py`` and
``jax_loop.py`` with the family's prefill/decode math, a
:class:`~trace_replay_app.drivers.torch_driver.TorchFamily` /
:class:`~trace_replay_app.drivers.jax_driver.JaxFamily` and ``run_decode = decoder(...)``;
``__init__.py`` building ``FAMILY``) and add one line to ``_FAMILIES`` below. Importing this
package imports no framework: loops load on :meth:`Family.run_decode`.

Example::

    from trace_replay_app.models import family_for_model_type, get_family
    gpt2 = get_family("gpt2")
    assert family_for_model_type("gpt2") is gpt2
    config = gpt2.default_config()
    weights = gpt2.seeded_weights(config, 0)
"""

from __future__ import annotations

from . import gpt2, llama
from .family import FRAMEWORKS, Family, FrameworkMissing, RunDecode

__all__ = [
    "Family",
    "FrameworkMissing",
    "FRAMEWORKS",
    "RunDecode",
    "families",
    "get_family",
    "family_for_model_type",
    "family_for_config",
    "supported_model_types",
]

_FAMILIES: tuple[Family, ...] = (
    gpt2.FAMILY,
    *llama.FAMILIES,
)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return _FAMILIES


def supported_model_types() -> tuple[str, ...]:
    """Every Hugging Face ``model_type`` some family serves, in registration order."""
    return tuple(t for f in _FAMILIES for t in f.model_types)


def get_family(name: str) -> Family:
    """The family called ``name``; ``ValueError`` naming it and the registered ones otherwise."""
    for f in _FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"model family {name!r} is not supported (supported: {', '.join(f.name for f in _FAMILIES)})")


def family_for_model_type(model_type: str) -> Family:
    """The family serving the Hugging Face ``model_type``; ``ValueError`` naming it and the
    supported list otherwise."""
    for f in _FAMILIES:
        if model_type in f.model_types:
            return f
    raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})")


def family_for_config(config) -> Family:
    """The family whose config class ``config`` is an instance of (``TypeError`` otherwise)."""
    for f in _FAMILIES:
        if isinstance(config, f.config_type):
            return f
    raise TypeError(
        f"config must be the config of a registered family "
        f"({', '.join(f.config_type.__name__ for f in _FAMILIES)}; got {type(config).__name__})"
    )
