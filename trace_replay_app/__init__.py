"""trace_replay_app: the ``trace-replay`` application on top of the library.

Layers (each imports only the ones above it; nothing imports this package):

- :mod:`.records` (requests in, results out), :mod:`.traces` (trace files, atomic writes) and
  :mod:`.rollouts` (rollouts as engines write them: vLLM, SGLang);
- :mod:`.models`: the registry of model families, each a framework-neutral config/weights
  module plus a PyTorch and a JAX decode loop (e.g. :mod:`.models.gpt2`), and
  :mod:`.checkpoint` (Hugging Face folders through ``safetensors``);
- :mod:`.schedule`: the continuous-batching decode schedule every loop shares; :mod:`.scoring`:
  the teacher-forced view every family's ``run_score`` shares;
- :mod:`.metrics` (the mismatch measures RL stacks log), :mod:`.sources` (what ``compare``
  reads), :mod:`.compare`, :mod:`.compare_plots`;
- :mod:`.runner`, :mod:`.commands`, :mod:`.demo`, :mod:`.cli`: the subcommands
  (``trace-replay`` / ``python -m trace_replay_app``);
- :mod:`.parity`, :mod:`.trace_sets`, :mod:`.pytest_plugin`: parity tests of a user's own
  torch model and its JAX port on the decode drivers, and a pytest plugin for them.

Importing it loads neither torch nor JAX: a framework is imported when a loop of it is asked for.
The loops use only the public names of ``trace_replay_core``, ``trace_replay_torch`` and
``trace_replay_jax``.
"""

from importlib.metadata import PackageNotFoundError, version

from .metrics import rl_metrics
from .models import Family, FrameworkMissing, families, family_for_model_type, get_family
from .records import RequestResult, TraceRequest
from .rollouts import ROLLOUT_FORMATS, Rollout, read_rollouts
from .traces import TraceFileError, random_requests, read_traces, write_traces

try:
    __version__ = version("trace-replay")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "TraceRequest",
    "RequestResult",
    "TraceFileError",
    "read_traces",
    "write_traces",
    "random_requests",
    "read_rollouts",
    "Rollout",
    "ROLLOUT_FORMATS",
    "rl_metrics",
    "Family",
    "FrameworkMissing",
    "families",
    "get_family",
    "family_for_model_type",
    "__version__",
]
