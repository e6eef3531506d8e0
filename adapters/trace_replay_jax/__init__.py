"""trace_replay_jax: trace replay for JAX decode loops.

Not implemented yet: this package currently exports nothing. Until it lands, a JAX loop can
use :class:`trace_replay_core.TraceTable` directly on CPU arrays.
"""

__all__: list = []
