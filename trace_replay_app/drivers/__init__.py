"""The decode drivers: one per framework, shared by every model family.

A driver owns what every family's decode loop has in common: the argument checks and the
schedule (:mod:`trace_replay_app.schedule`), the memory estimate checked against the device's
free memory before anything is allocated there, admission into slots, prefill grouping, the
replay state, sampling, logprob/rank/argmax from the unmodified logits, recording of the
per-step outputs and, for PyTorch, capture of the decode step in a CUDA graph. A family
supplies its config, its weight layout and its prefill/decode math
(``models/<name>/torch_loop.py`` and ``jax_loop.py``) and binds a driver to them.

- :mod:`.torch_driver`: :func:`~.torch_driver.decoder` (one device, or tensor-parallel over a
  ``torch.distributed`` job with ``tensor_parallel=``, :mod:`.torch_parallel`).
- :mod:`.jax_driver`: :func:`~.jax_driver.decoder` (one device, or a ``jax.sharding.Mesh`` with
  the logits sharded over the vocabulary with ``mesh=``); its chunked outputs and shape buckets
  in :mod:`.jax_chunks` (numpy only).
- :mod:`.memory`: the estimate and the free-memory check (numpy only).

Importing this package imports no framework; each driver module imports its own.
"""
