"""The planted faults: each a textual patch of the library, the tests to run, the test that must fail.

A :class:`Fault` names the file, one or more ``(old, new)`` replacements (each ``old`` must occur
exactly once), the test node ids to run with the fault in place, and the one expected to
catch it. Keep each test list small: every fault costs one pytest start.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    path: str
    patches: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    catcher: str  # the node id (or a prefix of it) expected among the failures


T = "trace_replay_core/"
PROPS_KERNELS = "tests/test_properties.py::TestInterpretedKernels"
PROPS_CPU = "tests/test_properties.py::TestCpuBackend"
KERNEL_METHOD = "tests/test_jax_kernel_replay.py::test_kernel_method_equals_jnp_and_the_reference"

_STAGE_FAILS = (
    "        arr = trace_array(tokens, max_trace_len=self.max_trace_len)\n        # The backend copies",
    '        calls = globals().setdefault("_planted_calls", [])\n'
    "        calls.append(1)\n"
    "        if len(calls) > 300:\n"
    '            raise RuntimeError("planted: stage fails after 300 calls")\n'
    "        arr = trace_array(tokens, max_trace_len=self.max_trace_len)\n        # The backend copies",
)

FAULTS = (
    # -- faults the thread helpers let through before they re-raised what workers raised --------
    Fault(
        "replay_cached always raises",
        T + "_table.py",
        (
            (
                "        launch = self._replays.get(key)\n        if launch is None:",
                '        raise RuntimeError("planted: replay_cached fails")\n'
                "        launch = self._replays.get(key)\n        if launch is None:",
            ),
        ),
        ("tests/test_bound_cache.py::test_replay_cached_from_many_threads",),
        "tests/test_bound_cache.py::test_replay_cached_from_many_threads",
    ),
    Fault(
        "stage raises after 300 calls",
        T + "_table.py",
        (_STAGE_FAILS,),
        ("tests/test_threads.py::test_staging_from_many_threads_cpu",),
        "tests/test_threads.py::test_staging_from_many_threads_cpu",
    ),
    # -- the CPU kernel method and its expected values sharing one numpy replay -------------------
    Fault(
        "numpy reference replays nothing (so does method='kernel' on the CPU)",
        T + "reference.py",
        (("        flat[b] = table[slot, s]\n", "        pass\n"),),
        (KERNEL_METHOD, "tests/test_jax_kernel_replay.py::test_kernel_method_with_int64_under_x64"),
        KERNEL_METHOD,
    ),
    Fault(
        "numpy reference replays nothing: parity's kernel legs",
        T + "reference.py",
        (("        flat[b] = table[slot, s]\n", "        pass\n"),),
        ("tests/test_parity.py::test_parity_cpu",),
        "tests/test_parity.py::test_parity_cpu",
    ),
    Fault(
        "numpy reference replays nothing: mesh cases' kernel legs",
        T + "reference.py",
        (("        flat[b] = table[slot, s]\n", "        pass\n"),),
        ("tests/test_jax_mesh.py",),
        "tests/test_jax_mesh.py::test_mesh_cases_on_8_cpu_host_devices",
    ),
    Fault(
        "kernel method's CPU callback writes nothing",
        "adapters/trace_replay_jax/kernel_replay.py",
        (("    res[...] = got\n", "    del got\n"),),
        (KERNEL_METHOD,),
        KERNEL_METHOD,
    ),
    # -- sentinels and refusals ---------------------------------------------------------------------
    Fault(
        "numpy replay ignores the trace length",
        T + "_numpy_backend.py",
        (("    active &= (n > 0) & (at >= 0) & (at < n)\n", "    active &= (at >= 0) & (at < table.shape[1])\n"),),
        ("tests/test_replay_cpu.py::test_uncommitted_traces_are_not_visible",),
        "tests/test_replay_cpu.py::test_uncommitted_traces_are_not_visible",
    ),
    Fault(
        "JAX view: refusal of a copy removed",
        "adapters/trace_replay_jax/views.py",
        (("    if array.unsafe_buffer_pointer() != view.ptr:\n", "    if False:\n"),),
        ("tests/test_jax_adapter.py::test_external_view_refuses_a_copy_where_a_view_was_asked_for",),
        "tests/test_jax_adapter.py::test_external_view_refuses_a_copy_where_a_view_was_asked_for",
    ),
    # -- kernels, host side: plans and launch arguments ---------------------------------------------
    Fault(
        "replay grid rounds down (rows past the first block left alone)",
        T + "kernels/replay.py",
        (
            (
                "    return ((rows + REPLAY_BLOCK - 1) // REPLAY_BLOCK, 1, 1)\n",
                "    return (max(1, rows // REPLAY_BLOCK), 1, 1)\n",
            ),
        ),
        (PROPS_KERNELS,),
        PROPS_KERNELS,
    ),
    Fault(
        "scatter grid drops the last entry",
        T + "kernels/scatter.py",
        (("    return (entries, chunks, 1)\n", "    return (max(1, entries - 1), chunks, 1)\n"),),
        (PROPS_KERNELS,),
        PROPS_KERNELS,
    ),
    Fault(
        "staged entry records one token too few",
        T + "_staging.py",
        (
            (
                "        self.entries[slot] = (slot, n, start)\n",
                "        self.entries[slot] = (slot, n - (n > 1024), start)\n",
            ),
        ),
        (PROPS_KERNELS,),
        PROPS_KERNELS,
    ),
    Fault(
        "numpy replay casts tokens through int16",
        T + "_numpy_backend.py",
        (
            (
                "    out[rows] = table[s[rows], at[rows]].astype(out.dtype)\n",
                "    out[rows] = table[s[rows], at[rows]].astype(np.int16)\n",
            ),
        ),
        ("tests/test_replay_cpu.py::test_replay_matches_reference",),
        "tests/test_replay_cpu.py::test_replay_matches_reference",
    ),
    Fault(
        "DLPack intake drops byte_offset",
        T + "_dlpack.py",
        (("    ptr = (t.data or 0) + t.byte_offset\n", "    ptr = t.data or 0\n"),),
        ("tests/test_dlpack.py::test_byte_offset_is_included", "tests/test_dlpack_byte_offset.py"),
        "tests/test_dlpack_byte_offset.py::test_the_view_starts_at_data_plus_byte_offset",
    ),
    Fault(
        "token ids equal to vocab_size accepted",
        T + "_staging.py",
        (
            (
                "    if (wide[wide.argmax()] if wide.ndim == 1 else wide.max()) >= limit:\n",
                "    if (wide[wide.argmax()] if wide.ndim == 1 else wide.max()) > limit:\n",
            ),
        ),
        ("tests/test_errors.py", PROPS_CPU),
        "tests/test_errors.py::test_core_refusals_change_nothing[trace-above-vocab]",
    ),
    Fault(
        "slot == max_slots accepted",
        T + "_validate.py",
        (("    if not 0 <= int(slot) < max_slots:\n", "    if not 0 <= int(slot) <= max_slots:\n"),),
        ("tests/test_errors.py",),
        "tests/test_errors.py",
    ),
    Fault(
        "bound cache evicts the newest entry",
        T + "_bound_cache.py",
        (
            (
                "                    del entries[next(iter(entries))]\n",
                "                    del entries[next(reversed(entries))]\n",
            ),
        ),
        ("tests/test_bound_cache.py::test_concurrent_misses_bind_each_key_once_and_keep_the_bound",),
        "tests/test_bound_cache.py::test_concurrent_misses_bind_each_key_once_and_keep_the_bound",
    ),
    # -- staging --------------------------------------------------------------------------------------
    Fault(
        "staging guard never waits",
        T + "_staging.py",
        (("                if not pair.event.done():\n", "                if False:\n"),),
        ("tests/test_staging.py::test_gpu_staging_guard_waits_for_in_flight_copies",),
        "tests/test_staging.py::test_gpu_staging_guard_waits_for_in_flight_copies",
    ),
    Fault(
        "a reused slot keeps its longer trace length",
        T + "_numpy_backend.py",
        (
            (
                "                self.trace_len[slot] = tokens.shape[0]\n",
                "                self.trace_len[slot] = max(int(self.trace_len[slot]), tokens.shape[0])\n",
            ),
        ),
        ("tests/test_replay_cpu.py::test_clear_and_reuse_slots",),
        "tests/test_replay_cpu.py::test_clear_and_reuse_slots",
    ),
    Fault(
        "staged clear does not reset the length (kernel path)",
        T + "_staging.py",
        (("        self.entries[slot] = (slot, 0, 0)\n", "        self.entries.pop(slot, None)\n"),),
        (PROPS_KERNELS,),
        PROPS_KERNELS,
    ),
    # -- adapters -------------------------------------------------------------------------------------
    Fault(
        "torch replay with explicit lengths not in place",
        "adapters/trace_replay_torch/state.py",
        (
            (
                "            error = _not_a_tensor(sampled=sampled, idx_mapping=idx_mapping, total_len=total_len,",
                "            sampled = sampled.clone()  # replays into a copy and returns it\n"
                "            error = _not_a_tensor(sampled=sampled, idx_mapping=idx_mapping, total_len=total_len,",
            ),
        ),
        ("tests/test_torch_adapter.py::test_adapter_matches_reference",),
        "tests/test_torch_adapter.py::test_adapter_matches_reference",
    ),
    Fault(
        "JAX replay ignores the sign of idx_mapping",
        "adapters/trace_replay_jax/jnp_replay.py",
        (("    active = (idx_mapping >= 0) & (idx_mapping < max_slots)\n", "    active = idx_mapping < max_slots\n"),),
        ("tests/test_jax_adapter.py::test_replay_matches_reference_and_returns_a_new_array",),
        "tests/test_jax_adapter.py::test_replay_matches_reference_and_returns_a_new_array",
    ),
    Fault(
        "torch named result: the entropy field holds the greedy tokens",
        "adapters/trace_replay_torch/logprob_results.py",
        (("(True, True, key[0], key[0], key[1], key[2])", "(True, True, key[0], key[0], key[1] or key[2], False)"),),
        ("tests/test_torch_entropy.py",),
        "tests/test_torch_entropy.py",
    ),
    # -- the entropy of token_logprob_rank ----------------------------------------------------------
    Fault(
        "numpy entropy: a -inf logit's term makes u NaN",
        T + "_numpy_backend.py",
        (
            (
                "                u = np.where(e == 0, np.float32(0), e * d).sum(axis=1)\n",
                "                u = (e * d).sum(axis=1)\n",
            ),
        ),
        ("tests/test_logprob_entropy.py::test_cpu_backend_entropy_matches_reference",),
        "tests/test_logprob_entropy.py::test_cpu_backend_entropy_matches_reference",
    ),
    Fault(
        "kernel entropy: u not moved to a line's new maximum",
        T + "kernels/_logprob_chunk_jit.py",
        (
            (
                "        kept = tl.where(c == 0, 0.0, c * (u + shift * s))\n",
                "        kept = tl.where(c == 0, 0.0, c * u)\n",
            ),
        ),
        ("tests/test_logprob_entropy.py::test_kernel_entropy_in_interpreter",),
        "tests/test_logprob_entropy.py::test_kernel_entropy_in_interpreter",
    ),
    Fault(
        "kernel entropy: a re-summed chunk keeps the fused path's u",
        T + "kernels/_logprob_rank_jit.py",
        (("                        tl.store(part_u_ptr + base + k, u_k)\n", "                        pass\n"),),
        ("tests/test_logprob_entropy.py::test_kernel_entropy_in_interpreter",),
        "tests/test_logprob_entropy.py::test_kernel_entropy_in_interpreter",
    ),
    # -- the command line -----------------------------------------------------------------------------
    Fault(
        "run exits 0 when a trace was not reproduced",
        "trace_replay_app/commands.py",
        (
            (
                'not reproduced exactly: {_ids(bad)}", file=sys.stderr)\n        status = 1\n',
                'not reproduced exactly: {_ids(bad)}", file=sys.stderr)\n        status = 0\n',
            ),
        ),
        ("tests/test_cli.py::test_run_exits_1_when_a_trace_is_not_reproduced",),
        "tests/test_cli.py::test_run_exits_1_when_a_trace_is_not_reproduced",
    ),
    Fault(
        "outputs written in place, no atomic rename",
        "trace_replay_app/traces.py",
        (
            (
                '    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")\n',
                "    tmp = os.path.join(folder, name)\n",
            ),
            ("os.O_WRONLY | os.O_CREAT | os.O_EXCL", "os.O_WRONLY | os.O_CREAT | os.O_TRUNC"),
        ),
        (
            "tests/test_cli.py::test_a_run_that_fails_midway_writes_nothing",
            "tests/test_traces.py::test_atomic_write_leaves_nothing_on_failure",
        ),
        "tests/test_traces.py::test_atomic_write_leaves_nothing_on_failure",
    ),
    # -- the adapters' footguns (#39): each guard removed, its test must notice -----------------------
    Fault(
        "#39 torch replay ignores writes staged but not applied",
        "adapters/trace_replay_torch/state.py",
        (('        if self._unapplied:\n            self._staged_not_applied("replay")\n', ""),),
        ("tests/test_staged_writes.py::test_torch_strict_raises_and_replays_nothing",),
        "tests/test_staged_writes.py::test_torch_strict_raises_and_replays_nothing",
    ),
    Fault(
        "#39 JAX strict state only warns",
        "adapters/trace_replay_jax/guards.py",
        (("        if self.strict:\n            raise RuntimeError(message)\n", ""),),
        ("tests/test_staged_writes.py::test_jax_strict_raises_and_changes_nothing",),
        "tests/test_staged_writes.py::test_jax_strict_raises_and_changes_nothing",
    ),
    Fault(
        "#39 closed-over tables with constant arguments accepted",
        "adapters/trace_replay_jax/jnp_replay.py",
        (
            (
                '        raise ValueError(_CLOSED_OVER.format(why="JAX traces the function that calls replay"))\n',
                "        pass\n",
            ),
        ),
        ("tests/test_jax_adapter_refusals.py::test_refusals_change_nothing",),
        "tests/test_jax_adapter_refusals.py::test_refusals_change_nothing[tables-closed-over",
    ),
    Fault(
        "#39 CPU kernel replay reads any table",
        "adapters/trace_replay_jax/kernel_replay.py",
        (("    _owner(_CPU, table.ctypes.data)\n", ""),),
        ("tests/test_jax_kernel_replay.py::test_kernel_method_refuses_a_table_no_open_state_owns_on_the_cpu",),
        "tests/test_jax_kernel_replay.py::test_kernel_method_refuses_a_table_no_open_state_owns_on_the_cpu",
    ),
    Fault(
        "#39 JAX device=None takes the first device, not the default",
        "adapters/trace_replay_jax/devices.py",
        (("        device = get_default_device()", "        device = jax.devices()[0]"),),
        ("tests/test_jax_devices.py",),
        "tests/test_jax_devices.py::test_device_cases_on_2_cpu_host_devices",
    ),
    Fault(
        "#39 int64 numpy ids wrapped by JAX without x64",
        "adapters/trace_replay_jax/guards.py",
        (("    if jax.config.jax_enable_x64:\n        return\n", "    return\n"),),
        ("tests/test_token_id_intake.py::test_logprob_token_ids_int32_cannot_hold_are_refused_without_x64",),
        "tests/test_token_id_intake.py::test_logprob_token_ids_int32_cannot_hold_are_refused_without_x64",
    ),
    Fault(
        "#39 torch float trace reaches DLPack",
        "adapters/trace_replay_torch/state.py",
        (("trace.dtype.is_floating_point or trace.dtype.is_complex or", "False and"),),
        ("tests/test_token_id_intake.py::test_torch_trace_that_is_not_integer_ids_is_refused_by_name",),
        "tests/test_token_id_intake.py::test_torch_trace_that_is_not_integer_ids_is_refused_by_name",
    ),
    # -- the drivers' decode attention, KV writes and batched prefill; compare's plot and RL table --
    Fault(
        "recent: jax cache_mix sums in the compute dtype",
        "trace_replay_app/drivers/jax_attention.py",
        (
            (
                "probs[..., None].astype(f32) * values[:, :, :, None, :].astype(f32), axis=1)",
                "probs[..., None] * values[:, :, :, None, :], axis=1)",
            ),
        ),
        ("tests/test_jax_attention.py::test_contractions_match_float64",),
        "tests/test_jax_attention.py::test_contractions_match_float64",
    ),
    Fault(
        "recent: jax cache_scores sums in the compute dtype",
        "trace_replay_app/drivers/jax_attention.py",
        (
            (
                "jnp.sum(q[:, None].astype(f32) * keys[:, :, :, None, :].astype(f32), axis=-1)",
                "jnp.sum(q[:, None] * keys[:, :, :, None, :], axis=-1)",
            ),
        ),
        ("tests/test_jax_attention.py::test_contractions_match_float64",),
        "tests/test_jax_attention.py::test_contractions_match_float64",
    ),
    Fault(
        "recent: llama jax query heads grouped kv-head-minor",
        "trace_replay_app/models/llama/jax_loop.py",
        (
            (
                "cache_scores(q.reshape(-1, c.num_key_value_heads, c.kv_groups, c.head_dim), kb)",
                "cache_scores(q.reshape(-1, c.kv_groups, c.num_key_value_heads, c.head_dim), kb)",
            ),
        ),
        ("tests/test_llama_loops.py::test_query_head_groups_larger_than_the_kv_heads",),
        "tests/test_llama_loops.py::test_query_head_groups_larger_than_the_kv_heads[jax]",
    ),
    Fault(
        "recent: llama jax sliding window one key wider",
        "trace_replay_app/models/llama/jax_loop.py",
        (("(kpos[None, :] > positions[:, None] - w)", "(kpos[None, :] >= positions[:, None] - w)"),),
        ("tests/test_llama_loops.py::test_matches_transformers[mistral-window-bf16-jax]",),
        "tests/test_llama_loops.py::test_matches_transformers[mistral-window-bf16-jax]",
    ),
    Fault(
        "recent: gpt2 jax masked softmax over the last axis (the einsum layout's)",
        "trace_replay_app/models/gpt2/jax_loop.py",
        (("jax.nn.softmax(scores, axis=1)", "jax.nn.softmax(scores, axis=-1)"),),
        ("tests/test_gpt2_loops.py::test_matches_reference",),
        "tests/test_gpt2_loops.py::test_matches_reference[jax",
    ),
    Fault(
        "recent: store_step_kv swaps keys and values",
        "trace_replay_app/drivers/torch_attention.py",
        (
            ("index[0], rows, positions), k.to(", "index[0], rows, positions), v.to("),
            ("index[1], rows, positions), v.to(", "index[1], rows, positions), k.to("),
        ),
        ("tests/test_gpt2_loops.py::test_matches_reference",),
        "tests/test_gpt2_loops.py::test_matches_reference[torch",
    ),
    Fault(
        "recent: store_step_kv keys at (0, layer), not (layer, 0)",
        "trace_replay_app/drivers/torch_attention.py",
        (("(index[layer], index[0], rows, positions)", "(index[0], index[layer], rows, positions)"),),
        ("tests/test_llama_loops.py::test_matches_transformers[qwen2-torch]",),
        "tests/test_llama_loops.py::test_matches_transformers[qwen2-torch]",
    ),
    Fault(
        "recent: flash_decode window one key wider",
        "trace_replay_app/drivers/torch_attention.py",
        (("window_size_left=window - 1 if window", "window_size_left=window if window"),),
        ("tests/test_llama_loops.py::test_flash_decode_arguments_through_a_cpu_double",),
        "tests/test_llama_loops.py::test_flash_decode_arguments_through_a_cpu_double",
    ),
    Fault(
        "recent: flash_decode reads one key fewer",
        "trace_replay_app/drivers/torch_attention.py",
        (("used = cu_q * kv_len, (positions + 1).to(", "used = cu_q * kv_len, positions.to("),),
        ("tests/test_llama_loops.py::test_flash_decode_arguments_through_a_cpu_double",),
        "tests/test_llama_loops.py::test_flash_decode_arguments_through_a_cpu_double",
    ),
    Fault(
        "recent: prefill_groups ignores the group limit",
        "trace_replay_app/drivers/jax_steps.py",
        (("max(1, min(limit, PREFILL_SCORES // (n * n)))", "max(1, PREFILL_SCORES // (n * n))"),),
        ("tests/test_jax_prefill_groups.py::test_prefill_groups",),
        "tests/test_jax_prefill_groups.py::test_prefill_groups",
    ),
    Fault(
        "recent: _admit_group writes from the second entry on",
        "trace_replay_app/drivers/jax_steps.py",
        (("jax.lax.fori_loop(0, slots.shape[0], write", "jax.lax.fori_loop(1, slots.shape[0], write"),),
        ("tests/test_jax_prefill_groups.py",),
        "tests/test_jax_prefill_groups.py::test_batched_prefill_gives_the_results_of_one_program_per_prompt",
    ),
    Fault(
        "recent: a prefill group's prompt lengths are its bucket-padded prefixes'",
        "trace_replay_app/drivers/jax_steps.py",
        (("[len(prompts[i]) for i in group]", "[len(prefixes[i]) for i in group]"),),
        ("tests/test_jax_prefill_groups.py",),
        "tests/test_jax_prefill_groups.py::test_batched_prefill_gives_the_results_of_one_program_per_prompt",
    ),
    Fault(
        "recent: plot's mean lines one colour on from the histogram's",
        "trace_replay_app/compare_plots.py",
        (
            (
                "    for color, pair in zip(PAIR_COLORS, pair_reports(report)):\n        per_pair",
                "    for color, pair in zip(PAIR_COLORS[1:], pair_reports(report)):\n        per_pair",
            ),
        ),
        ("tests/test_compare_plots.py",),
        "tests/test_compare_plots.py::test_pair_colours_match_across_panels",
    ),
    Fault(
        "recent: ratio axis log when the ratios are close, linear when wide",
        "trace_replay_app/compare_plots.py",
        (("wide = hi / lo >= 2", "wide = hi / lo < 2"),),
        ("tests/test_compare_plots.py",),
        "tests/test_compare_plots.py::test_ratio_axis_follows_the_spread",
    ),
    Fault(
        "recent: linear ratio axis plots the ratio, not the ratio minus 1",
        "trace_replay_app/compare_plots.py",
        (("ax.hist(r if wide else (r - 1) / scale", "ax.hist(r if wide else r / scale"),),
        ("tests/test_compare_plots.py",),
        "tests/test_compare_plots.py::test_ratio_axis_follows_the_spread",
    ),
    Fault(
        "recent: linear ratio bins span the ratios above 1 only",
        "trace_replay_app/compare_plots.py",
        (("half = max(hi - 1, 1 - lo, 1e-12)", "half = max(hi - 1, 1e-12)"),),
        ("tests/test_compare_plots.py",),
        "tests/test_compare_plots.py::test_ratio_axis_follows_the_spread",
    ),
    Fault(
        "recent: linear ratio axis marks 1, not 0",
        "trace_replay_app/compare_plots.py",
        (("ax.axvline(1.0 if wide else 0.0,", "ax.axvline(1.0,"),),
        ("tests/test_compare_plots.py",),
        "tests/test_compare_plots.py::test_ratio_axis_follows_the_spread",
    ),
    Fault(
        "recent: RL table label with a space again",
        "trace_replay_app/commands.py",
        (('"mismatch_kl_max"),', '"mismatch_kl max"),'),),
        ("tests/test_cli_compare.py::test_rollout_against_decode_and_score",),
        "tests/test_cli_compare.py::test_rollout_against_decode_and_score",
    ),
    Fault(
        "recent: RL table kl and k3_kl labels swapped",
        "trace_replay_app/commands.py",
        (
            (
                '("verl/rollout_corr/k3_kl", "k3_kl"),\n    ("verl/rollout_corr/kl", "kl"),',
                '("verl/rollout_corr/k3_kl", "kl"),\n    ("verl/rollout_corr/kl", "k3_kl"),',
            ),
        ),
        ("tests/test_cli_compare.py::test_rollout_against_decode_and_score",),
        "tests/test_cli_compare.py::test_rollout_against_decode_and_score",
    ),
    # -- the Llama family's model types (phi3, olmo2/3, smollm3, gemma2/3, yarn) ----------------
    Fault(
        "types: YaRN's cos/sin scale dropped (JAX)",
        "trace_replay_app/models/llama/jax_loop.py",
        (
            (
                "    if factor != 1:\n        cos, sin = cos * factor, sin * factor",
                "    if False:\n        cos, sin = cos * factor, sin * factor",
            ),
        ),
        ("tests/test_llama_model_types.py::test_matches_transformers[qwen3-yarn-jax]",),
        "tests/test_llama_model_types.py::test_matches_transformers[qwen3-yarn-jax]",
    ),
    Fault(
        "types: windowed layers take the full layers' rotary embedding (torch)",
        "trace_replay_app/models/llama/torch_loop.py",
        (
            (
                "(None, None) if i in c.nope_layers else local if c.window(i) else rope",
                "(None, None) if i in c.nope_layers else rope",
            ),
        ),
        ("tests/test_llama_model_types.py::test_matches_transformers[olmo3-yarn-window-torch]",),
        "tests/test_llama_model_types.py::test_matches_transformers[olmo3-yarn-window-torch]",
    ),
    Fault(
        "types: SmolLM3's NoPE layers rotated (torch)",
        "trace_replay_app/models/llama/torch_loop.py",
        (("(None, None) if i in c.nope_layers else local", "local"),),
        ("tests/test_llama_model_types.py::test_matches_transformers[smollm3-nope-window-torch]",),
        "tests/test_llama_model_types.py::test_matches_transformers[smollm3-nope-window-torch]",
    ),
    Fault(
        "types: Gemma's norm scales by the weight, not 1 + weight (torch)",
        "trace_replay_app/models/llama/torch_layers.py",
        (('weight.float() + 1.0 if style == "gemma" else weight.float()', "weight.float()"),),
        ("tests/test_llama_model_types.py::test_matches_transformers[gemma3-window-torch]",),
        "tests/test_llama_model_types.py::test_matches_transformers[gemma3-window-torch]",
    ),
    Fault(
        "types: Gemma's embeddings unscaled (torch)",
        "trace_replay_app/models/llama/torch_loop.py",
        (("            x = x * self.embed_mult", "            x = x"),),
        ("tests/test_llama_model_types.py::test_matches_transformers[gemma3-window-torch]",),
        "tests/test_llama_model_types.py::test_matches_transformers[gemma3-window-torch]",
    ),
    Fault(
        "types: the attention and MLP output norms swapped (JAX)",
        "trace_replay_app/models/llama/jax_loop.py",
        (('_rms(out, w["attention_out"], eps, style) if post', '_rms(out, w["mlp_out"], eps, style) if post'),),
        ("tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-jax]",),
        "tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-jax]",
    ),
    Fault(
        "types: Gemma 2's score cap dropped in masked decode (torch)",
        "trace_replay_app/models/llama/torch_loop.py",
        (("            scores = softcap(scores, c.attn_logit_softcapping)\n", ""),),
        ("tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-torch]",),
        "tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-torch]",
    ),
    Fault(
        "types: Gemma 2's logits cap dropped (JAX)",
        "trace_replay_app/models/llama/jax_loop.py",
        (('_softcap(logits, p["logit_cap"].astype(logits.dtype)) if "logit_cap" in p else logits', "logits"),),
        ("tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-jax]",),
        "tests/test_llama_model_types.py::test_matches_transformers[gemma2-softcap-jax]",
    ),
    Fault(
        "types: mistral's key/value heads when config.json leaves them out (transformers: 8)",
        "trace_replay_app/models/llama/hf.py",
        (('"mistral": {"sliding_window": 4096, "num_key_value_heads": 8}', '"mistral": {"sliding_window": 4096}'),),
        ("tests/test_llama_config.py::test_keys_left_out_read_as_transformers_defaults_them[mistral]",),
        "tests/test_llama_config.py::test_keys_left_out_read_as_transformers_defaults_them[mistral]",
    ),
    Fault(
        "types: a rollout key shown raw in the one-line error",
        "trace_replay_app/rollouts.py",
        (("    text = key if key.isprintable() else repr(key)", "    text = key"),),
        ("tests/test_rollouts.py::test_bad_lines_name_file_line_and_field",),
        "tests/test_rollouts.py::test_bad_lines_name_file_line_and_field[auto/control_char_key]",
    ),
)
