"""The decode drivers: one per framework, shared by every model family.

A driver owns what every family's decode loop has in common: the argument checks and the
schedule (:mod:`trace_replay_app.schedule`), the memory estimate checked against the device's
free memory before anything is allocated there, admission into slots, prefill grouping, the
replay state, sampling, logprob/rank/argmax from the unmodified logits, recording of the
per-step outputs and, for PyTorch, capture of the decode step in a CUDA graph. A model keeps
one small protocol per framework (:class:`~.torch_driver.TorchDecodeModel`: ``new_cache``,
``prefill``, ``decode``; :class:`~.jax_driver.JaxDecodeModel`: ``new_cache``, ``prefill``,
``write``, ``decode``, pure): a user's own model goes to ``decode_model``, and a registry
family (``models/<name>/torch_loop.py`` and ``jax_loop.py``: its config, weight layout and
math) binds a driver to it, its ``run_decode`` building the model and then running the same
steps.

- :mod:`.torch_driver`: :func:`~.torch_driver.decode_model` and
  :func:`~.torch_driver.decoder` (one device, or tensor-parallel over a ``torch.distributed``
  job with ``tensor_parallel=``, :mod:`.torch_parallel`); the steps in :mod:`.torch_steps`.
- :mod:`.jax_driver`: :func:`~.jax_driver.decode_model` and :func:`~.jax_driver.decoder` (one
  device, or a ``jax.sharding.Mesh`` with the logits sharded over the vocabulary with
  ``mesh=``); the jitted steps in :mod:`.jax_steps`, chunked outputs and shape buckets in
  :mod:`.jax_chunks` (numpy only).
- :mod:`.memory`: the estimate and the free-memory check (numpy only).

Importing this package imports no framework; each driver module imports its own.
"""
