"""What a model family is: the record the registry keeps per family, and the decode-loop contract.

A family is one framework-neutral config/weights module (numpy only) plus its prefill/decode
math in PyTorch and in JAX, each bound to that framework's one decode driver
(:mod:`trace_replay_app.drivers`), e.g. ``models/gpt2/{config,torch_loop,jax_loop}.py``. Its
package's ``__init__`` builds one :class:`Family` named ``FAMILY``; ``models/__init__.py`` lists it.

The config object of every family exposes ``vocab_size`` and ``n_positions`` (the most prompt +
decoded tokens of one request): trace files and the schedule check requests against those two.

Every loop is a function with this signature (the contract both drivers keep for every family;
torch adds ``cuda_graph=`` and ``tensor_parallel=``, JAX ``mesh=`` and ``vocab_axis=``)::

    run_decode(config, weights, requests, *, device="cpu", max_batch=8, on_step=None,
               dtype="float32", temperature=0.0, seed=0, logprobs_mode="raw_logprobs")
        -> list[RequestResult]

``weights``: numpy float arrays under the family's names (the caller's arrays are not changed);
``requests``: :class:`~trace_replay_app.records.TraceRequest`; ``device``: ``"cpu"``, ``"cuda"``
or ``"cuda:N"``; ``max_batch``: the most slots decoding together on the shared schedule
(:mod:`trace_replay_app.schedule`; a run uses ``min(max_batch, requests that decode)``);
``on_step(k)``: called on the host after each step is queued with the tokens it decodes;
``dtype``: compute dtype, ``"float32"`` or ``"bfloat16"``;
``temperature``: 0 = greedy (ties: lowest id), else sampling from ``softmax(logits / T)``
with the ``seed`` (reproducible for the same arguments). Traced requests are forced onto their
traces; logprobs and ranks are those of the float32 logits as they are (``logprobs_mode``
``"raw_logprobs"``) or, with ``"processed_logprobs"`` when sampling, of ``logits /
temperature`` (vLLM's names). A rejected
call raises ``TypeError``/``ValueError`` naming the argument, before anything runs; a run that
cannot fit in the device's free memory raises :class:`~trace_replay_app.records.DeviceMemoryError`
before anything is allocated there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["Family", "FrameworkMissing", "FRAMEWORKS", "RunDecode", "loop_loader"]

FRAMEWORKS = ("torch", "jax")

RunDecode = Callable[..., list]


def loop_loader(loop_module: Callable[[str], ModuleType]) -> Callable[..., RunDecode]:
    """A family's ``load_loop(framework, entry="run_decode")``: ``entry`` of the family's loop
    module for ``framework`` (``"torch"`` or ``"jax"``, else ``ValueError``), which
    ``loop_module(framework)`` imports with a plain import (nothing loads a framework before it
    is asked for)."""

    def load_loop(framework: str, entry: str = "run_decode") -> RunDecode:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be 'torch' or 'jax' (got {framework!r})")
        return getattr(loop_module(framework), entry)

    return load_loop


class FrameworkMissing(ImportError):
    """A family's decode loop for a framework cannot be imported (the framework is not
    installed, or fails to import); the message says what to install."""

    def __init__(self, family: str, framework: str, cause: BaseException):
        self.family, self.framework = family, framework
        super().__init__(
            f"the {framework} decode loop of {family} cannot be imported ({cause}); install the "
            f"framework, e.g. pip install 'trace-replay[{framework}]'"
        )


@dataclasses.dataclass(eq=False)
class Family:
    """One model family of the registry (see the module docstring).

    ``name``: what ``--model`` takes; ``label``: what it is, in words (e.g. "GPT-2-style
    model"). ``model_types``: the Hugging Face ``config.json`` ``model_type`` values it serves.
    ``config_type``: its config class. ``config_from_hf(hf)``:
    the config of a ``config.json`` mapping (``ValueError`` naming the key for what it does not
    support). ``default_config()``: a small config for seeded runs. ``seeded_weights(config,
    seed)``: deterministic float32 weights. ``weights_from_tensors(config, tensors)``: a
    checkpoint's tensors (Hugging Face names, float arrays) -> the loops' weights, prefixes
    stripped, names and shapes checked (``ValueError`` naming the tensor and both shapes).
    ``check_weights(config, weights)``: ``ValueError`` naming a missing, unexpected or
    mis-shaped parameter. ``load_loop(framework, entry="run_decode")``: imports and returns
    that framework's ``run_decode`` (or ``entry``, ``"run_score"``; plain imports inside the
    function: nothing loads a framework before it is asked for). ``to_hf(config, weights,
    **options)``: optional, ``(config.json mapping, tensors)`` for writing a checkpoint (tests,
    benchmarks). ``describe(config)``: the sizes in
    a few words. Registered once; tests may replace ``load_loop`` to simulate a missing framework.
    """

    name: str
    label: str
    model_types: tuple[str, ...]
    config_type: type
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    default_config: Callable[[], Any]
    seeded_weights: Callable[[Any, int], dict[str, np.ndarray]]
    weights_from_tensors: Callable[[Any, Mapping[str, np.ndarray]], dict[str, np.ndarray]]
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None]
    load_loop: Callable[[str], RunDecode]
    to_hf: Callable[..., tuple[dict[str, Any], dict[str, np.ndarray]]] | None = None
    describe: Callable[[Any], str] = repr

    def run_decode(self, framework: str) -> RunDecode:
        """``framework``'s decode loop of this family, imported now.

        Raises ``ValueError`` for a framework other than ``"torch"``/``"jax"`` and
        :class:`FrameworkMissing` when its loop cannot be imported. Host-only."""
        return self._load(framework, ())

    def run_score(self, framework: str) -> RunDecode:
        """``framework``'s teacher-forced ``run_score`` of this family (contract:
        :mod:`trace_replay_app.scoring`), imported now; errors as :meth:`run_decode`."""
        return self._load(framework, ("run_score",))

    def _load(self, framework: str, entry: tuple[str, ...]) -> RunDecode:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)} (got {framework!r})")
        try:
            return self.load_loop(framework, *entry)
        except ImportError as exc:
            raise FrameworkMissing(self.name, framework, exc) from None
