"""The ``trace-replay`` application: trace files, a small GPT-2-style reference model, and the
command line (``trace-replay`` / ``python -m trace_replay_core``).

Everything in this subpackage is numpy-only, like the rest of the core. The reference decode
loops that run the model live in the adapters (``trace_replay_torch.gpt2``,
``trace_replay_jax.gpt2``); the command line imports the one the user names, so importing
``trace_replay_core`` (or this subpackage) still loads neither torch nor jax.
"""
