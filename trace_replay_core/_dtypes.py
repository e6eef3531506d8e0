"""The dtypes the library accepts, by name, in one place.

Names are DLPack's as :class:`~trace_replay_core.ArrayView` reports them (``"int32"``,
``"bfloat16"`` ...). Adapters translate their framework's dtypes to these names; nothing else
defines its own list.
"""

from __future__ import annotations

__all__ = ["TOKEN_DTYPES", "INDEX_DTYPES", "LOGITS_DTYPES", "RANK_DTYPES"]

#: ``sampled`` and token ids: JAX's default int32 and PyTorch's int64.
TOKEN_DTYPES = ("int32", "int64")
#: ``idx_mapping``, the per-slot lengths and the per-row step.
INDEX_DTYPES = ("int32", "int64")
#: logits read by the logprob kernel (converted exactly to float32 on load).
LOGITS_DTYPES = ("float32", "bfloat16", "float16")
#: ranks written by the logprob kernel.
RANK_DTYPES = ("int32", "int64")
