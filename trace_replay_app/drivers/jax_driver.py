"""The JAX decode driver every model runs on: one jitted program per step, replay inside it.

Two entry points, one path (:func:`.jax_steps.run_model`):

- :func:`decode_model` runs requests through a model that keeps the :class:`JaxDecodeModel`
  protocol (pure functions and a cache pytree of its own layout) with its parameters: a
  user's own model (no checkpoint, no registration; :class:`JaxModel` bundles the functions)
  or a registry family's (:meth:`JaxFamily.model`).
- :func:`decoder` binds the driver to a registry family's :class:`JaxFamily` (its config
  class and weight check, its parameter pytree, its empty KV cache, its prefill/write/decode
  math) and returns the family's ``run_decode`` (the contract of
  :mod:`trace_replay_app.models.family`): the checks and memory estimate, the parameters
  placed, then the same steps as :func:`decode_model` on :meth:`JaxFamily.bind`'s model.

The driver owns, once for every model: the checks and the schedule, the memory estimate before
anything is allocated, admission (the prompt prefilled in a bucket, its keys and values into
the slot), the jitted step (logits, Gumbel-max sampling with the noise of step ``t`` from
``fold_in(key(seed), t)``, :func:`trace_replay_jax.replay`, logprob/rank/argmax in one read of
the logits, outputs appended to fixed chunks), and one copy of the outputs to the host.

With ``mesh=`` (a ``jax.sharding.Mesh``; family-only), the same run spans the mesh's devices:
the output projection (``[hidden, vocab]``) is sharded along the vocabulary over
``vocab_axis``, every other weight, the KV cache, the lengths and the outputs are replicated;
the argmax (and the Gumbel-max draw) over the sharded logits merges each block's maximum in
block order (ties: the lowest id), replay runs on a :class:`trace_replay_jax.TraceReplayState`
over the mesh, and logprob and rank come from :func:`trace_replay_jax.token_logprob_rank_sharded`.
Tokens equal the one-device run's; logprobs agree to float32 rounding, ranks exactly. The
registry's families run float32 matrix products at ``precision="highest"``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_replay_jax import resolve_device

from ..records import RequestResult, TraceRequest
from ..schedule import DecodeCall, check_decode, check_model_call, check_run, check_sampling, collect_results
from . import jax_chunks
from .jax_attention import attention_for
from .jax_chunks import bucket
from .jax_placement import device_params, free_bytes, placed_params
from .jax_steps import Carry, run_model, sharded_argmax
from .memory import check_fits, estimate_bytes

__all__ = [
    "JaxDecodeModel",
    "JaxModel",
    "JaxFamily",
    "Carry",
    "decode_model",
    "decoder",
    "free_bytes",
    "placed_params",
    "device_params",
    "sharded_argmax",
]


class JaxDecodeModel(Protocol):
    """What :func:`decode_model` needs of a JAX model: pure functions over a parameter pytree
    and a KV cache pytree of the model's own layout, batch rows serving slots. The model is a
    static argument of the driver's jitted programs: it must be hashable, and equal models
    share compiled programs (a frozen dataclass of module-level functions, as :class:`JaxModel`).

    ``vocab_size``: token ids are below it, and ``decode`` returns that many logits per row.
    ``n_positions``: the most prompt + decoded tokens one request may hold (the cache the
    driver asks for is never longer).

    ``new_cache(slots, kv_len)``: the cache pytree for ``slots`` slots of ``kv_len`` positions
    (zeros, or anything: every position is written before a query reads it); called once per
    run, on the run's default device. The driver holds it in the step's carry, donates it to
    each step and passes it back; it never reads it.

    ``prefill(params, tokens)``: the keys and values (any pytree; what ``write`` takes) of one
    prompt ``tokens`` (int32 ``[bucket]``, positions ``0 .. bucket-1``; the prompt but its last
    token, right-padded with zeros to a power of two: padding positions may hold garbage that
    a decode step overwrites before any query reads it). Jitted alone, once per bucket size.

    ``write(cache, kv, slot)``: the cache with ``kv`` at positions ``0 ..`` of ``slot`` (an
    int32 scalar array). Jitted with the admission (the cache donated).

    ``decode(params, cache, tokens, positions)``: one token per row, row ``b`` feeding
    ``tokens[b]`` (int32 ``[rows]``) at ``positions[b]`` (int32 ``[rows]``) to slot ``b``'s
    cache, attending to positions ``<= positions[b]``; returns ``(logits [rows, vocab_size]``
    (float32, bfloat16 or float16) ``, cache)`` with the step's keys and values stored. A row
    that decodes nothing gets position 0 and any token. Traced into the jitted step.

    All four are traced by ``jax.jit``: pure, no host callbacks, shapes fixed by their
    arguments' shapes.

    ``batched_prefill`` (optional attribute, default False): True lets the driver prefill the
    prompts admitted together that share a bucket size in one program, ``jax.vmap(prefill)``
    over them (each prompt computed as alone, up to the rounding of the batched products), and
    write each into its slot; False: one ``prefill`` program per prompt.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def n_positions(self) -> int: ...

    def new_cache(self, slots: int, kv_len: int) -> Any: ...

    def prefill(self, params: Any, tokens: jax.Array) -> Any: ...

    def write(self, cache: Any, kv: Any, slot: jax.Array) -> Any: ...

    def decode(self, params: Any, cache: Any, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Any]: ...


@dataclasses.dataclass(frozen=True)
class JaxModel:
    """A :class:`JaxDecodeModel` made of the caller's functions (see there for each one's
    contract); hashable, and equal when built from the same functions and sizes, so runs of
    one model share compiled programs (module-level functions are; a new closure per run
    compiles again)."""

    vocab_size: int
    n_positions: int
    new_cache: Callable[[int, int], Any]
    prefill: Callable[[Any, jax.Array], Any]
    write: Callable[[Any, Any, jax.Array], Any]
    decode: Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
    batched_prefill: bool = False


@dataclasses.dataclass(frozen=True)
class JaxFamily:
    """What a family gives the JAX driver (pure functions; ``config`` is a static, hashable value).

    ``config_type``, ``check_weights``: its config class and weight check.
    ``params(config, weights, head)``: host pytree of float32 numpy arrays from the caller's
    weights (copies); with ``head=True`` it holds the output projection as ``"head"``
    ``[hidden, vocab]`` (the mesh shards it). ``new_cache(config, slots, kv_len, dtype)``: the
    zero KV cache pytree. ``prefill(params, config, tokens)``: the keys and values of one prompt
    ``tokens`` ``[bucket]`` (positions ``0 ..``) in the layout ``write`` takes.
    ``write(cache, kv, slot)``: the cache with ``kv`` at positions ``0 ..`` of ``slot``.
    ``decode(params, config, cache, tokens, positions, attention)``: one token per row, row ``b``
    feeding ``tokens[b]`` at ``positions[b]`` to slot ``b``'s cache; returns ``(logits [rows,
    vocab], cache)`` with the step's keys and values stored (``attention`` as for ``hidden``,
    from :func:`.jax_attention.attention_for`). For ``score``
    (:mod:`~trace_replay_app.drivers.jax_score`): ``hidden(params, config, tokens, attention)``,
    the final-norm hidden states ``[requests, n, hidden]`` of right-padded ``tokens``
    ``[requests, n]`` (causal, no cache; ``attention``: ``"cudnn"`` or ``"xla"``, the fused
    attention's implementation), and ``logits(params, hidden)``, the output projection.
    ``batched_prefill``: as :class:`JaxDecodeModel`'s (``prefill`` vmappable over prompts)."""

    config_type: type
    check_weights: Callable[[Any, Mapping[str, np.ndarray]], None]
    params: Callable[[Any, Mapping[str, np.ndarray], bool], Any]
    new_cache: Callable[[Any, int, int, Any], Any]
    prefill: Callable[..., Any]
    write: Callable[[Any, Any, Any], Any]
    decode: Callable[..., tuple[jax.Array, Any]]
    hidden: Callable[..., jax.Array]
    logits: Callable[[Any, jax.Array], jax.Array]
    batched_prefill: bool = False

    def bind(self, config: Any, dtype: Any = "float32", attention: str = "xla") -> FamilyModel:
        """The family's :class:`JaxDecodeModel` of ``config`` with its cache in ``dtype`` and
        its decode attention by ``attention`` (:func:`.jax_attention.attention_for`); hashable:
        equal arguments give an equal model."""
        return FamilyModel(self, config, jnp.dtype(dtype), attention)

    def model(
        self, config: Any, weights: Mapping[str, np.ndarray], *, device: str = "cpu", dtype: str = "float32"
    ) -> tuple[FamilyModel, Any]:
        """``(model, params)``: the family's :class:`JaxDecodeModel` of ``config`` and its
        parameters from ``weights`` (numpy arrays, copied; the caller's are not changed) on
        ``device`` in the compute ``dtype`` (``"float32"`` or ``"bfloat16"``), for
        :func:`decode_model`, e.g. one side of a parity test (the bits of the family's
        ``run_decode``). Arguments are checked first (``TypeError``/``ValueError`` naming them)."""
        check_run(config, weights, [], 1, None, config_type=self.config_type, check_weights=self.check_weights)
        check_sampling(dtype, 0.0, 0)
        jdtype, dev = jnp.dtype(dtype), resolve_device(device)
        return self.bind(config, jdtype, attention_for(dev, jdtype)), device_params(self, config, weights, dev, jdtype)


@dataclasses.dataclass(frozen=True)
class FamilyModel:
    """A registry family's :class:`JaxDecodeModel` (:meth:`JaxFamily.bind`): its functions
    with ``config`` bound and its cache in ``dtype``; hashable by value."""

    family: JaxFamily
    config: Any
    dtype: Any
    attention: str = "xla"

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def n_positions(self) -> int:
        return self.config.n_positions

    @property
    def batched_prefill(self) -> bool:
        return self.family.batched_prefill

    def new_cache(self, slots: int, kv_len: int) -> Any:
        return self.family.new_cache(self.config, slots, kv_len, self.dtype)

    def prefill(self, params: Any, tokens: jax.Array) -> Any:
        return self.family.prefill(params, self.config, tokens)

    def write(self, cache: Any, kv: Any, slot: jax.Array) -> Any:
        return self.family.write(cache, kv, slot)

    def decode(self, params: Any, cache: Any, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Any]:
        return self.family.decode(params, self.config, cache, tokens, positions, self.attention)


def decode_model(
    model: JaxDecodeModel,
    params: Any,
    requests: Sequence[TraceRequest],
    *,
    device: str = "cpu",
    max_batch: int = 8,
    on_step: Callable[[int], None] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[RequestResult]:
    """Decode ``requests`` through ``model`` (:class:`JaxDecodeModel`) with ``params`` (its
    parameter pytree), replaying their traces: the driver of every family's ``run_decode``,
    on a model of the caller's.

    ``params`` go to ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``) with
    ``jax.device_put`` as they are (no cast: the model computes in its parameters' dtype;
    arrays already there are not copied; the caller's are not changed). ``max_batch``,
    ``on_step``, ``temperature``, ``seed`` and the results as in a family's ``run_decode``
    (see :func:`_run`): one :class:`~trace_replay_app.records.RequestResult` per request, in
    request order; logprobs in float32 of the raw logits whatever their dtype; token ids int32
    on the device, int64 in the results. Requests are checked against ``model.vocab_size`` and
    ``model.n_positions`` before anything runs (``TypeError``/``ValueError`` naming the
    argument); the model's cache (its shape from ``jax.eval_shape``) and the driver's buffers
    are checked against the device's free memory before they are allocated
    (:class:`~trace_replay_app.records.DeviceMemoryError`). Nothing waits for the device
    between steps; the outputs are copied to the host once at the end."""
    for name in ("new_cache", "prefill", "write", "decode"):
        if not callable(getattr(model, name, None)):
            raise TypeError(f"model must have a callable {name}() (a JaxDecodeModel; got a {type(model).__name__})")
    try:
        hash(model)
    except TypeError:
        raise TypeError(
            f"model must be hashable: it is a static argument of jitted programs (got an unhashable "
            f"{type(model).__name__}; use a frozen dataclass such as JaxModel)"
        ) from None
    call = check_model_call(
        model, requests, max_batch=max_batch, on_step=on_step, temperature=temperature, seed=seed, device=device
    )
    dev = resolve_device(device)  # ValueError when JAX has no such device
    outputs = None
    if call.schedule.n_steps:
        kv_len = bucket(call.kv_positions, model.n_positions)
        cache = jax.eval_shape(lambda: model.new_cache(call.schedule.slots, kv_len))
        cache_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))
        check_fits(
            device, _estimate(call, model.n_positions, model.vocab_size, {}, 0, 0) + cache_bytes, free_bytes(dev)
        )
        put = functools.partial(jax.device_put, device=dev)
        outputs = run_model(model, put(params), call, dev, put=put, mesh=None, vocab_axis="vocab")
    return collect_results(requests, call.schedule, outputs)


def _estimate(call: DecodeCall, n_positions: int, vocab_size: int, weights, itemsize: int, cache_elements: int) -> int:
    return estimate_bytes(
        weights=weights,
        itemsize=itemsize,
        cache_elements=cache_elements,
        slots=call.schedule.slots,
        steps=min(call.schedule.n_steps, 2 * jax_chunks.CHUNK),  # the chunk being written and the one set aside
        vocab_size=vocab_size,
        longest_trace=bucket(call.longest_trace, n_positions),
        sampling=call.temperature > 0,
    )


def decoder(family: JaxFamily) -> Callable[..., list[RequestResult]]:
    """The ``run_decode`` of ``family`` on this driver (see :func:`_run` for the contract)."""

    def run_decode(
        config: Any,
        weights: Mapping[str, np.ndarray],
        requests: Sequence[TraceRequest],
        *,
        device: str = "cpu",
        max_batch: int = 8,
        on_step: Callable[[int], None] | None = None,
        dtype: str = "float32",
        temperature: float = 0.0,
        seed: int = 0,
        mesh: Mesh | None = None,
        vocab_axis: str = "vocab",
        logprobs_mode: str = "raw_logprobs",
    ) -> list[RequestResult]:
        return _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed,
                    mesh, vocab_axis, logprobs_mode)  # fmt: skip

    run_decode.__doc__ = _run.__doc__
    return run_decode


def _run(family, config, weights, requests, device, max_batch, on_step, dtype, temperature, seed, mesh, vocab_axis,
         logprobs_mode):  # fmt: skip
    """Decode ``requests`` with the model ``config``/``weights``, replaying their traces.

    Arguments and results as in the torch driver's ``run_decode`` (the family contract of
    :mod:`trace_replay_app.models.family`), except the sampling noise: with ``temperature``
    above 0, untraced rows sample by Gumbel-max, the noise of step ``t`` drawn from
    ``jax.random.fold_in(jax.random.key(seed), t)`` (the same arguments give the same tokens,
    not the torch loop's). ``max_batch``: the most slots; the run uses ``min(max_batch,
    requests that decode)`` and buffers sized by the requests' real lengths (padded to
    power-of-two buckets). ``mesh``: run on the devices of a ``jax.sharding.Mesh`` instead of
    ``device`` (which must then be left at ``"cpu"``, its default), the logits sharded over
    ``vocab_axis`` (``vocab_size`` a multiple of its size; other axes hold replicas; with
    ``logprobs_mode="raw_logprobs"`` only when sampling). Token ids are int32 on the device and
    int64 in the results. Outputs are copied to the host once at the end. Arguments are checked
    before anything runs (``TypeError`` / ``ValueError`` naming the argument); a run that would
    not fit in a device's free memory raises :class:`~trace_replay_app.records.DeviceMemoryError`.
    """
    call = check_decode(
        config,
        weights,
        requests,
        max_batch=max_batch,
        on_step=on_step,
        dtype=dtype,
        temperature=temperature,
        seed=seed,
        config_type=family.config_type,
        check_weights=family.check_weights,
        device=device,
        logprobs_mode=logprobs_mode,
    )
    if mesh is not None and call.logprob_temperature is not None:
        raise ValueError("logprobs_mode='processed_logprobs' with sampling is not supported with a mesh")
    if mesh is None:
        devices = [resolve_device(device)]  # ValueError when JAX has no such device
    else:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None (got {type(mesh).__name__})")
        if device != "cpu":
            raise ValueError(f"device must be left at 'cpu' when a mesh is given (got device={device!r})")
        if vocab_axis not in mesh.axis_names:
            raise ValueError(f"vocab_axis must be one of the mesh's axes {mesh.axis_names} (got {vocab_axis!r})")
        shards = mesh.shape[vocab_axis]
        if config.vocab_size % shards:
            raise ValueError(
                f"config.vocab_size={config.vocab_size} does not split evenly over the {shards} devices "
                f"of vocab_axis {vocab_axis!r}"
            )
        devices = list(mesh.devices.flat)
    outputs = None
    if call.schedule.n_steps:
        jdtype = jnp.dtype(call.dtype)
        kv_len = bucket(call.kv_positions, config.n_positions)
        slots = call.schedule.slots
        cache = jax.eval_shape(lambda: family.new_cache(config, slots, kv_len, jdtype))
        elements = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(cache))
        needed = _estimate(call, config.n_positions, config.vocab_size, weights, jdtype.itemsize, elements)
        for dev in devices:  # the caller's name of its device, or each device of the mesh
            check_fits(device if mesh is None else str(dev), needed, free_bytes(dev))
        outputs = _decode_all(family, config, weights, call, devices[0], jdtype, mesh, vocab_axis)
    return collect_results(requests, call.schedule, outputs)


def _decode_all(family: JaxFamily, config, weights, call: DecodeCall, dev, dtype, mesh, vocab_axis):
    """The family's parameters placed (on ``dev``, or over ``mesh``), then every step of
    ``call.schedule`` on :meth:`JaxFamily.bind`'s model (:func:`.jax_steps.run_model`); the
    per-step outputs ``[n_steps, slots]`` on the host."""
    if mesh is None:
        put = functools.partial(jax.device_put, device=dev)
        params = device_params(family, config, weights, dev, dtype)
    else:
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, P()))
        params = placed_params(family, config, weights, mesh, vocab_axis, dtype)
    model = family.bind(config, dtype, attention_for(dev, dtype) if mesh is None else "xla")
    return run_model(model, params, call, dev, put=put, mesh=mesh, vocab_axis=vocab_axis)
