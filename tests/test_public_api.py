"""Every package's public API, pinned: the names in ``__all__`` and, for functions and methods,
their parameters (names, kinds, defaults). A change here is a change users see: update the pin
on purpose (``python tests/api_surface.py PACKAGE`` prints the current surface)."""

import pytest
from helpers.api_surface import surface

PINNED = {
    "trace_replay_app": {
        "Family": {
            "__init__": "(self, name, label, model_types, config_type, config_from_hf, "
            "default_config, seeded_weights, weights_from_tensors, "
            "check_weights, load_loop, to_hf=None, describe=<built-in "
            "function repr>)",
            "describe": "(obj)",
            "run_decode": "(self, framework)",
            "run_score": "(self, framework)",
        },
        "FrameworkMissing": {"__init__": "(self, family, framework, cause)"},
        "ROLLOUT_FORMATS": "('trace', 'openai-completions', 'openai-chat', 'sglang', 'vllm-offline')",
        "RequestResult": {
            "__init__": "(self, id, tokens, forced, logprobs, ranks, argmax, entropy=None, topk_logprobs=None, "
            "topk_ids=None)"
        },
        "Rollout": {"__init__": "(self, request, logprobs, logprobs_mode=None, line=0)"},
        "TraceFileError": {"__init__": "(self, path, line, field, message)"},
        "TraceRequest": {"__init__": "(self, id, prompt, trace=None, max_new_tokens=0)", "new_tokens": "property"},
        "__version__": "'0.1.0'",
        "families": "()",
        "family_for_model_type": "(model_type)",
        "get_family": "(name)",
        "random_requests": "(config, n, *, seed=0, traced=1.0, prompt_len=(1, 24), new_tokens=(1, 24), prefix='r')",
        "read_rollouts": "(path, config=None, *, format='auto', requests_path=None)",
        "read_traces": "(path, config=None)",
        "rl_metrics": "(*, train, rollout, is_threshold=2.0, tis_clip_low=0.0, rollout_is='token')",
        "write_traces": "(path, requests)",
    },
    "trace_replay_core": {
        "ArrayView": {
            "__init__": "(self, ptr, shape, strides, dtype, device_type, device_id, readonly=False, keepalive=None)",
            "describe": "(self)",
            "device": "property",
            "is_c_contiguous": "property",
            "ndim": "property",
            "size": "property",
        },
        "BoundCache": {"__init__": "(self, size)", "bind": "(self, key, bind)", "clear": "(self)"},
        "BoundLogprobBackward": {},
        "BoundLogprobRank": {"__call__": "(self, *, stream)", "__init__": "(self, launch, views)", "release": "(self)"},
        "BoundReplay": {
            "__call__": "(self, *, stream)",
            "__init__": "(self, table, launch, views)",
            "release": "(self)",
        },
        "INDEX_DTYPES": "('int32', 'int64')",
        "LOGITS_DTYPES": "('float32', 'bfloat16', 'float16')",
        "MAX_VOCAB": "1073741824",
        "PLACEMENTS": "('device', 'host_mapped')",
        "RANK_DTYPES": "('int32', 'int64')",
        "TOKEN_DTYPES": "('int32', 'int64')",
        "TOPK_MAX": "64",
        "StagedWritesWarning": {},
        "CudaError": {},
        "TraceTable": {
            "__enter__": "(self)",
            "__exit__": "(self, *exc)",
            "__init__": "(self, max_slots, max_trace_len, *, device, "
            "placement='device', vocab_size=None, staging_depth=4, "
            "staging_bytes=1048576)",
            "bind_lengths": "(self, total_len, prompt_len, *, stream)",
            "bind_replay": "(self, sampled, idx_mapping, total_len=None, prompt_len=None, step=None, *, stream)",
            "clear": "(self, slot)",
            "close": "(self)",
            "closed": "property",
            "commit": "(self, *, stream)",
            "device_views": "(self)",
            "lengths_bound": "property",
            "nbytes": "property",
            "pending": "property",
            "replay": "(self, sampled, idx_mapping, total_len, prompt_len, *, stream)",
            "replay_at_step": "(self, sampled, idx_mapping, step, *, stream)",
            "replay_cached": "(self, key, sampled, idx_mapping, total_len=None, prompt_len=None, step=None, *, stream)",
            "snapshot": "(self)",
            "stage": "(self, slot, tokens)",
            "stage_many": "(self, slots, traces, *, distinct=False)",
            "synchronize": "(self)",
        },
        "as_view": "(obj, *, name, stream=None)",
        "bind_logprob_rank": "(logits, token_ids, *, out_logprobs, out_ranks, stream, "
        "workspace=None, temperature=None, top_k=0, "
        "out_topk_logprobs=None, out_topk_ids=None, out_argmax=None, out_entropy=None)",
        "check_top_k": "(top_k, vocab)",
        "default_device": "()",
        "logprob_rank_workspace_bytes": "(batch, vocab, top_k=0)",
        "parse_device": "(device)",
        "replay_reference": "(sampled, idx_mapping, table, trace_len, total_len=None, prompt_len=None, step=None)",
        "split_device": "(device)",
        "stream_handle": "(stream, *, name='stream')",
        "token_logprob_rank": "(logits, token_ids, *, out_logprobs, out_ranks, stream, "
        "workspace=None, temperature=None, top_k=0, "
        "out_topk_logprobs=None, out_topk_ids=None, out_argmax=None, out_entropy=None)",
        "token_logprob_rank_reference": "(logits, token_ids)",
        "token_logprob_rank_backward": "(logits, token_ids, logprobs, *, out_grad_logits, stream, "
        "grad_logprobs=None, temperature=None, out_grad_temperature=None, argmax=None, topk_ids=None, "
        "topk_logprobs=None, grad_topk_logprobs=None, entropy=None, grad_entropy=None, workspace=None)",
        "logprob_backward_workspace_bytes": "(batch, vocab, grad_temperature=False)",
        "bind_logprob_rank_backward": "(logits, token_ids, logprobs, *, out_grad_logits, stream, "
        "grad_logprobs=None, temperature=None, out_grad_temperature=None, argmax=None, topk_ids=None, "
        "topk_logprobs=None, grad_topk_logprobs=None, entropy=None, grad_entropy=None, workspace=None)",
        "greedy_argmax_reference": "(logits)",
        "softmax_entropy_reference": "(logits)",
    },
    "trace_replay_jax": {
        "LogprobRank": {},
        "LogprobRankArgmax": {},
        "LogprobRankTopK": {},
        "LogprobRankTopKArgmax": {},
        "LogprobRankEntropy": {},
        "LogprobRankArgmaxEntropy": {},
        "LogprobRankTopKEntropy": {},
        "LogprobRankTopKArgmaxEntropy": {},
        "ReplayTables": {"__init__": "(self, table, trace_len)"},
        "StagedWritesWarning": {},
        "TraceReplayState": {
            "__enter__": "(self)",
            "__exit__": "(self, *exc)",
            "__init__": "(self, max_slots, max_trace_len, *, device=None, "
            "mesh=None, placement='device', vocab_size=None, "
            "staging_depth=4, strict=False)",
            "add_request": "(self, slot, trace=None)",
            "add_requests": "(self, slots, traces)",
            "apply_staged_writes": "(self)",
            "close": "(self)",
            "closed": "property",
            "pending": "property",
            "remove_request": "(self, slot)",
            "replay": "(self, sampled, idx_mapping, total_len, prompt_len, *, method='jnp')",
            "replay_at_step": "(self, sampled, idx_mapping, step, *, method='jnp')",
            "snapshot": "(self)",
            "strict": "property",
            "tables": "property",
        },
        "replay": "(tables, sampled, idx_mapping, total_len, prompt_len, *, method='jnp')",
        "resolve_device": "(device)",
        "replay_at_step": "(tables, sampled, idx_mapping, step, *, method='jnp')",
        "token_logprob_rank": "(logits, token_ids, *, method='kernel', top_k=0, temperature=None, argmax=False, "
        "entropy=False)",
        "token_logprob_rank_in_shard_map": "(logits, token_ids, *, vocab_axis)",
        "token_logprob_rank_sharded": "(logits, token_ids, *, mesh, vocab_axis, batch_axis=None, top_k=0, "
        "temperature=None, argmax=False, entropy=False)",
    },
    "trace_replay_torch": {
        "LogprobRank": {},
        "LogprobRankArgmax": {},
        "LogprobRankTopK": {},
        "LogprobRankTopKArgmax": {},
        "LogprobRankEntropy": {},
        "LogprobRankArgmaxEntropy": {},
        "LogprobRankTopKEntropy": {},
        "LogprobRankTopKArgmaxEntropy": {},
        "StagedWritesWarning": {},
        "TraceReplayState": {
            "__enter__": "(self)",
            "__exit__": "(self, *exc)",
            "__init__": "(self, max_slots, max_trace_len, *, device, "
            "total_len=None, prompt_len=None, "
            "placement='device', vocab_size=None, "
            "staging_depth=4, strict=False)",
            "add_request": "(self, slot, trace=None)",
            "add_requests": "(self, slots, traces)",
            "apply_staged_writes": "(self)",
            "bind_lengths": "(self, total_len, prompt_len)",
            "close": "(self)",
            "closed": "property",
            "op_id": "property",
            "remove_request": "(self, slot)",
            "replay": "(self, sampled, idx_mapping, total_len=None, prompt_len=None)",
            "replay_at_step": "(self, sampled, idx_mapping, step)",
            "strict": "property",
        },
        "replay_at_step_op": "(state, sampled, idx_mapping, step)",
        "replay_op": "(state, sampled, idx_mapping, total_len=None, prompt_len=None)",
        "token_logprob_rank": "(logits, token_ids, *, top_k=0, temperature=None, out=None, argmax=False, "
        "entropy=False)",
        "token_logprob_rank_op": "(logits, token_ids, *, top_k=0, temperature=None, argmax=False, entropy=False)",
    },
}


@pytest.mark.parametrize("package", sorted(PINNED))
def test_public_api_is_pinned(package):
    got = surface(package)
    assert sorted(got) == sorted(PINNED[package]), "names in __all__ changed"
    for name, want in PINNED[package].items():
        assert got[name] == want, name


@pytest.mark.parametrize("package", sorted(PINNED))
def test_all_lists_only_what_the_package_defines_and_nothing_private(package):
    import importlib

    module = importlib.import_module(package)
    assert len(set(module.__all__)) == len(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)
    assert not [n for n in module.__all__ if n.startswith("_") and n != "__version__"]


@pytest.mark.parametrize("package", ["trace_replay_torch"])
def test_a_public_name_a_module_imports_from_a_sibling_is_in_the_siblings_all(package):
    """Inside the adapter, ``from .module import name`` (a public name) takes something that
    ``module.__all__`` lists and that ``module`` defines: a module's ``__all__`` says what it
    exports to its siblings, not only to users."""
    import ast
    import importlib
    import pathlib

    folder = pathlib.Path(importlib.import_module(package).__file__).parent
    missing = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                module = importlib.import_module(f"{package}.{node.module}")
                for alias in node.names:
                    if alias.name.startswith("_"):
                        continue
                    if alias.name not in module.__all__ or not hasattr(module, alias.name):
                        missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert not missing, missing
