"""trace_replay_core: replay recorded token traces inside any decode loop, on the GPU.

Framework-neutral: arrays arrive over DLPack, streams as explicit handles, memory and events
through NVIDIA's cuda-bindings, kernels are Triton kernels launched compiled. A numpy
backend with identical semantics runs everything on a machine without a GPU.

Example (CPU backend; on a GPU pass ``device="cuda"`` and device arrays)::

    import numpy as np
    from trace_replay_core import TraceTable

    with TraceTable(max_slots=4, max_trace_len=8, device="cpu") as table:
        table.stage(2, [5, 6, 7])
        table.commit(stream=0)
        sampled = np.array([9, 9], dtype=np.int64)           # the sampler's draw
        idx_mapping = np.array([2, 0], dtype=np.int32)       # batch row -> slot
        total_len = np.array([4, 0, 11, 0], dtype=np.int32)  # per slot: prompt + outputs so far
        prompt_len = np.array([4, 0, 10, 0], dtype=np.int32)
        table.replay(sampled, idx_mapping, total_len, prompt_len, stream=0)
        assert sampled.tolist() == [6, 9]                    # slot 2 is at step 1 of its trace

Importing this package loads neither torch nor jax (nor NVIDIA's driver bindings, until a GPU
is used). A CUDA driver call that fails raises :class:`CudaError`, naming the call and the
driver's error.
"""

from ._bound_cache import BoundCache
from ._cuda import CudaError
from ._devices import default_device, parse_device, split_device
from ._dlpack import ArrayView, as_view
from ._dtypes import INDEX_DTYPES, LOGITS_DTYPES, RANK_DTYPES, TOKEN_DTYPES
from ._logprob import (
    MAX_VOCAB,
    TOPK_MAX,
    BoundLogprobRank,
    bind_logprob_rank,
    check_top_k,
    logprob_rank_workspace_bytes,
    token_logprob_rank,
)
from ._logprob_backward import (
    BoundLogprobBackward,
    bind_logprob_rank_backward,
    logprob_backward_workspace_bytes,
    token_logprob_rank_backward,
)
from ._streams import stream_handle
from ._table import PLACEMENTS, BoundReplay, TraceTable
from ._warnings import StagedWritesWarning
from .reference import (
    greedy_argmax_reference,
    replay_reference,
    softmax_entropy_reference,
    token_logprob_rank_reference,
)

__all__ = [
    # the trace table and its replays
    "TraceTable",
    "BoundReplay",
    "PLACEMENTS",
    "StagedWritesWarning",
    "CudaError",
    # logprob and rank of the chosen token
    "token_logprob_rank",
    "bind_logprob_rank",
    "BoundLogprobRank",
    "logprob_rank_workspace_bytes",
    "check_top_k",
    "MAX_VOCAB",
    "TOPK_MAX",
    # its gradient
    "token_logprob_rank_backward",
    "bind_logprob_rank_backward",
    "BoundLogprobBackward",
    "logprob_backward_workspace_bytes",
    # the numpy reference of both ops
    "replay_reference",
    "token_logprob_rank_reference",
    "greedy_argmax_reference",
    "softmax_entropy_reference",
    # arrays, streams, devices, dtypes
    "ArrayView",
    "as_view",
    "stream_handle",
    "parse_device",
    "split_device",
    "default_device",
    "BoundCache",
    "TOKEN_DTYPES",
    "INDEX_DTYPES",
    "LOGITS_DTYPES",
    "RANK_DTYPES",
]

__version__ = "0.1.0"
