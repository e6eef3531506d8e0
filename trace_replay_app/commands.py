"""The ``run``, ``score`` and ``compare`` subcommands of ``trace-replay`` (the parser and the
entry point: :mod:`trace_replay_app.cli`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from .models import FRAMEWORKS
from .outputs import reproduced, result_to_json, run_summary, write_json_document
from .runner import (
    CliError,
    check_framework_device,
    check_outputs,
    check_sampling_seed,
    decode_options,
    load_loop,
    load_model,
    load_weights,
    model_summary,
    prepare_run,
    read_requests,
    replay_requests,
    say,
    stage,
)
from .schedule import slots_for
from .traces import stop_if_interrupted

__all__ = ["cmd_run", "cmd_score", "cmd_compare", "framework_list"]


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")


def _f(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _report_non_finite(command: str, s: dict) -> bool:
    """Whether run summary ``s`` counts logprobs that are not finite; if so, say how many and in
    which requests on stderr, as ``trace-replay <command>`` (the command then exits 1)."""
    if not s["non_finite_logprobs"]:
        return False
    bad = s["requests_with_non_finite_logprobs"]
    print(
        f"trace-replay {command}: {s['non_finite_logprobs']} logprobs are not finite (written as null) in "
        f"{len(bad)} requests: {_ids(bad)}",
        file=sys.stderr,
    )
    return True


def _inputs(args) -> list[tuple[str, str | None]]:
    """The input files a run or score reads, as ``(option, path)``: no output may replace one."""
    return [("--traces", args.traces), ("--requests", args.requests)]


# subcommands ------------------------------------------------------------------------------------
def cmd_run(args, out: TextIO) -> int:
    check_outputs([("--out", args.out)], _inputs(args), args.checkpoint)
    check_sampling_seed(args)
    family, config, source, requests, weights, loops = prepare_run(args, [args.framework])
    decode = decode_options(args)
    results, seconds = replay_requests(args.framework, config, weights, requests, loop=loops[args.framework],
                                       device=args.device, max_batch=args.max_batch,
                                       show_progress=False if args.quiet else None, **decode)  # fmt: skip
    s = run_summary(requests, results, seconds)
    head = {
        "summary": dict(
            s,
            framework=args.framework,
            device=args.device,
            max_batch=args.max_batch,
            slots=slots_for([q.new_tokens for q in requests], args.max_batch),
            traces=args.traces,
            **model_summary(family, config, source, decode),
        )
    }
    rows = [result_to_json(q, r) for q, r in zip(requests, results, strict=True)]
    write_json_document(args.out, head, "requests", rows)
    say(
        out,
        args.quiet,
        f"{args.framework} on {args.device}: {s['requests']} requests ({s['traced_requests']} "
        f"traced), {s['tokens']} tokens in {s['seconds']:.2f} s ({_f(s['tokens_per_s'], '.0f')} tokens/s)",
    )
    if s["forced_tokens"]:
        say(
            out,
            args.quiet,
            f"exact reproduction: {s['exact_reproductions']}/{s['traced_requests']} traced "
            f"requests; forced tokens: mean logprob {_f(s['mean_forced_logprob'], '.3f')}, "
            f"mean rank {_f(s['mean_forced_rank'], '.1f')}",
        )
    say(out, args.quiet, f"wrote {args.out}")
    status = 0
    if s["exact_reproductions"] != s["traced_requests"]:
        bad = [q.id for q, r in zip(requests, results, strict=True) if reproduced(q, r) is False]
        print(f"trace-replay run: {len(bad)} traced requests were not reproduced exactly: {_ids(bad)}", file=sys.stderr)
        status = 1
    if _report_non_finite("run", s):
        status = 1
    return status


def _score_temperature(args) -> float | None:
    """The temperature ``score`` takes its logprobs at: ``--temperature`` (default 1) for
    processed_logprobs, None for raw ones; :class:`CliError` for a temperature that would do
    nothing (raw logprobs) or that processed logprobs cannot take (0)."""
    given = args.temperature
    if args.logprobs_mode == "raw_logprobs":
        if given is not None:
            raise CliError(f"--temperature {given:g}: has no effect on raw_logprobs (the logits as they are; "
                           "--logprobs-mode processed_logprobs takes logits / T)")  # fmt: skip
        return None
    if given is not None and given <= 0:
        raise CliError(f"--temperature {given:g}: processed_logprobs are the logprobs of logits / T: give T above 0")
    return 1.0 if given is None else given


def _check_top_k(top_k: int):
    """A check of ``--top-k`` against the model's config (run before the weights are read)."""

    def check(config) -> None:
        if top_k > config.vocab_size:
            raise CliError(f"--top-k {top_k}: above the model's vocabulary of {config.vocab_size} tokens")

    return check


def cmd_score(args, out: TextIO) -> int:
    check_outputs([("--out", args.out)], _inputs(args), args.checkpoint)
    temperature = _score_temperature(args)
    family, config, source, requests, weights, loops = prepare_run(
        args, [args.framework], score=True, check=_check_top_k(args.top_k)
    )
    untraced = [r.id for r in requests if r.trace is None]
    if untraced:
        raise CliError(f"--traces {args.traces}: score needs each request's completion; no trace in {_ids(untraced)}")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    stage(f"{args.framework}-score")
    t0 = time.perf_counter()
    stop_if_interrupted()
    results = loops[args.framework](config, weights, requests, device=args.device, dtype=dtype,
                                    logprobs_mode=args.logprobs_mode, temperature=temperature or 1.0,
                                    max_tokens=args.max_tokens, chunk_rows=args.chunk_rows,
                                    top_k=args.top_k)  # fmt: skip
    s = run_summary(requests, results, time.perf_counter() - t0)
    options = dict(dtype=dtype, temperature=temperature, seed=None, logprobs_mode=args.logprobs_mode)  # no sampling
    summary = dict(s, framework=args.framework, device=args.device, traces=args.traces, view="teacher-forced")
    summary.update(max_tokens=args.max_tokens, chunk_rows=args.chunk_rows, top_k=args.top_k)
    summary.update(model_summary(family, config, source, options))
    rows = [result_to_json(q, r) for q, r in zip(requests, results, strict=True)]
    write_json_document(args.out, {"summary": summary}, "requests", rows)
    say(
        out,
        args.quiet,
        f"{args.framework} on {args.device}: scored {s['tokens']} tokens of {s['requests']} requests in "
        f"{s['seconds']:.2f} s; mean logprob {_f(s['mean_forced_logprob'], '.3f')}, mean rank "
        f"{_f(s['mean_forced_rank'], '.1f')}",
    )
    say(out, args.quiet, f"wrote {args.out}")
    return 1 if _report_non_finite("score", s) else 0


def framework_list(option: str, text: str | None) -> list[str]:
    """``"torch,jax"`` -> ``["torch", "jax"]`` (order kept, no repeats); :class:`CliError`
    naming ``option`` for anything else."""
    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in FRAMEWORKS for n in names) or len(set(names)) != len(names):
        raise CliError(f"{option} {text}: give frameworks among {', '.join(FRAMEWORKS)}, comma-separated, once each")
    return names


def _compare_inputs(args):
    """The requests and sources of a ``compare`` call, in order: the files given, then the
    ``--run`` and ``--score`` runs it makes itself (today's ``--traces FILE`` alone: ``--run
    torch,jax``); also the report's summary additions. Everything that can be refused is
    refused before the weights are read and the runs made."""
    from .sources import (
        check_same_requests,
        load_source,
        output_requests,
        requests_file_for,
        results_source,
        unique_names,
    )

    runs, scores = framework_list("--run", args.run), framework_list("--score", args.score)
    if args.traces is not None and not args.sources and not runs and not scores:
        runs = list(FRAMEWORKS)
    if not args.sources and args.traces is None:
        raise CliError("give the files to compare (run or score outputs, rollout files), or --traces FILE")
    making = runs + scores
    _run_options(args, runs, scores)
    if len(args.sources) + len(making) < 2:
        got = len(args.sources) + len(making)
        raise CliError(f"compare needs at least two sources (got {got}): add files, --run or --score")
    need_model = bool(making) or args.checkpoint is not None or args.model is not None
    family = config = weights = None
    if need_model:
        family, config, model_source = load_model(args.model, args.checkpoint, args.seed)
    files = [*([args.traces] if args.traces is not None else []), *args.sources]
    bodies: dict[str, str] = {}  # the one file --requests goes with
    sources = []
    try:
        if args.requests is not None:
            bodies[os.path.realpath(requests_file_for(files, args.format, args.requests))] = args.requests
        for path in args.sources:
            sources.append(
                load_source(path, config, format=args.format, requests_path=bodies.get(os.path.realpath(path)))
            )
    except ValueError as exc:  # TraceFileError too
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"{exc.filename or ', '.join(files)}: cannot read ({exc.strerror or exc})") from None
    if args.traces is not None:
        requests = read_requests(
            args.traces, config, format=args.format, requests_path=bodies.get(os.path.realpath(args.traces))
        )
    else:
        requests = next((list(s.requests) for s in sources if s.requests is not None), None)
        if requests is None and making:
            raise CliError("--run/--score need the requests: give --traces FILE or a rollout file among the files")
    if requests is None:  # only output files: their reference's requests, as far as it records them
        requests = output_requests(sources[0])
    modes = {s.name: s.logprobs_mode for s in sources if s.logprobs_mode is not None}
    if args.logprobs_mode is not None and not making:  # given for the files alone: a check of theirs
        other = ", ".join(f"{n} {m}" for n, m in modes.items() if m != args.logprobs_mode)
        if other:
            raise CliError(f"--logprobs-mode {args.logprobs_mode}: the files' logprobs are of another kind: {other}")
    args.logprobs_mode = args.logprobs_mode or "raw_logprobs"
    modes.update({name: args.logprobs_mode for name in [*runs, *(f"{fw}-score" for fw in scores)]})
    if len(set(modes.values())) > 1:
        kinds = ", ".join(f"{n} {m}" for n, m in modes.items())
        raise CliError(f"the sources' logprobs are of different kinds: {kinds} (--logprobs-mode sets the runs')")
    untraced = [r.id for r in requests if r.trace is None]
    if scores and untraced:
        raise CliError(f"--score needs each request's completion; no trace in {_ids(untraced)}")
    try:
        check_same_requests(requests, sources, None if args.traces is None else f"--traces {args.traces}")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    extra: dict = {}
    if making:
        assert family is not None
        for fw in making:
            check_framework_device(fw, args.device)
        weights = load_weights(family, config, model_source)
        stop_if_interrupted()  # a Ctrl-C that Python could not raise where it landed (an import's callbacks)
        decode = decode_options(args)
        extra.update(device=args.device, traces=args.traces, **model_summary(family, config, model_source, decode))
        summaries = {}
        for fw in runs:
            results, seconds = replay_requests(fw, config, weights, requests, loop=load_loop(family, fw),
                                               device=args.device, max_batch=args.max_batch,
                                               show_progress=False if args.quiet else None, **decode)  # fmt: skip
            summaries[fw] = run_summary(requests, results, seconds)
            sources.append(results_source(fw, "decode", results, args.logprobs_mode, requests))
        for fw in scores:
            stage(f"{fw}-score")
            t0 = time.perf_counter()
            results = load_loop(family, fw, score=True)(
                config, weights, requests, device=args.device, dtype=decode["dtype"],
                logprobs_mode=args.logprobs_mode, temperature=args.temperature or 1.0,
            )  # fmt: skip
            summaries[f"{fw}-score"] = run_summary(requests, results, time.perf_counter() - t0)
            sources.append(results_source(f"{fw}-score", "teacher-forced", results, args.logprobs_mode, requests))
        if runs:  # the decode slots: the option, and those the runs took
            extra.update(max_batch=args.max_batch, slots=slots_for([q.new_tokens for q in requests], args.max_batch))
        extra.update(runs=summaries)
    return unique_names(sources), requests, extra


def _run_options(args, runs: Sequence[str], scores: Sequence[str]) -> None:
    """Refuse compare's run options that would change nothing in this call (exit 2 naming the
    option), then give those left out their defaults (``--logprobs-mode``: see the caller)."""
    nothing = "compare runs no model without --run or --score"
    processed = args.logprobs_mode == "processed_logprobs"
    unused = {
        "device": None if runs or scores else nothing,
        "dtype": None if runs or scores else nothing,
        "max_batch": None if runs else "only --run decodes in slots",
        "sampling_seed": None if runs and args.temperature else "only --run samples, at --temperature above 0",
        "temperature": None
        if runs or (scores and processed)
        else ("--score takes no temperature for raw_logprobs" if scores else nothing),
    }
    for name, why in unused.items():
        if why is not None and getattr(args, name) is not None:
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)}: has no effect here ({why})")
    for name, default in {"device": "cpu", "max_batch": 8, "temperature": 0.0, "sampling_seed": 0}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def cmd_compare(args, out: TextIO) -> int:
    from .compare import (
        GATED_MEASURES,
        RL_METRIC_KEYS,
        batch_gate_failures,
        compare_sources,
        gate_failures,
        output_paths,
        pair_reports,
        summary_lines,
    )
    from .compare_plots import plot_divergence

    inputs = [("--traces", args.traces), ("--requests", args.requests), *(("FILE", p) for p in args.sources)]
    report_path, plot_path, create = output_paths(args.out_dir, args.report, args.plot, inputs, args.checkpoint)
    gates = list(args.fail_above) + ([("k3", args.max_k3)] if args.max_k3 is not None else [])
    for metric, _ in gates:
        if metric not in GATED_MEASURES and metric not in RL_METRIC_KEYS:
            raise CliError(f"--fail-above {metric}: give a per-request measure ({', '.join(GATED_MEASURES)}) or an "
                           "rl_metrics key such as verl/rollout_corr/k3_kl")  # fmt: skip
    sources, requests, extra = _compare_inputs(args)
    try:
        report = compare_sources(requests, sources)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    report["summary"].update(extra)
    if create is not None:
        os.makedirs(create, exist_ok=True)
    head = {k: report[k] for k in ("summary", "per_position", "sources", "pairs")}
    write_json_document(report_path, head, "requests", report["requests"])
    try:
        plot_divergence(report, plot_path)
        wrote = f"wrote {report_path} and {plot_path}"
    except ImportError:
        wrote = f"wrote {report_path}; plot skipped: matplotlib is not installed (pip install matplotlib)"
    pairs = pair_reports(report)
    for pair in pairs:
        for line in summary_lines(pair):
            say(out, args.quiet, line)
    for line in _rl_table(pairs):
        say(out, args.quiet, line)
    for name, s in extra.get("runs", {}).items():
        say(out, args.quiet, f"{name}: {s['tokens']} tokens in {s['seconds']:.2f} s; exact reproduction "
                             f"{s['exact_reproductions']}/{s['traced_requests']} traced requests")  # fmt: skip
    say(out, args.quiet, wrote)
    status = 0
    runs = extra.get("runs", {})
    failed = [
        fw for fw, s in runs.items() if not fw.endswith("-score") and s["exact_reproductions"] != s["traced_requests"]
    ]
    if failed:
        print(
            f"trace-replay compare: traced requests were not reproduced exactly by {', '.join(failed)}", file=sys.stderr
        )
        status = 1
    bad = sorted({i for pair in pairs for i in pair["summary"]["requests_with_non_finite_logprobs"]})
    if bad:
        print(f"trace-replay compare: {len(bad)} requests have non-finite logprobs: {_ids(bad)}", file=sys.stderr)
        status = 1
    for metric, limit in gates:
        max_k3 = (metric, limit) == ("k3", args.max_k3)
        option = f"--max-k3 {limit:g}" if max_k3 else f"--fail-above {metric}={limit:g}"
        measure = "k3 KL estimate" if metric == "k3" else metric
        if metric in GATED_MEASURES:
            above = [f for pair in pairs for f in gate_failures(pair, metric, limit)]
            what = "requests"
        else:
            above, what = batch_gate_failures(report, metric, limit), "pairs"
        if above:
            print(f"trace-replay compare: {len(above)} {what} fail {option} ({measure} above it or missing): "
                  f"{', '.join(above)}", file=sys.stderr)  # fmt: skip
            status = 1
    return status


RL_COLUMNS = (
    ("verl/rollout_corr/k3_kl", "k3_kl"),
    ("verl/rollout_corr/kl", "kl"),
    ("verl/rollout_corr/log_ppl_abs_diff", "log_ppl_abs_diff"),
    ("verl/rollout_corr/ppl_ratio", "ppl_ratio"),
    ("verl/rollout_corr/chi2_token", "chi2_token"),
    ("prime_rl/mismatch_kl/all/max", "mismatch_kl_max"),
    ("slime/train/train_rollout_logprob_abs_diff", "logprob_abs_diff"),
)


def _rl_table(pairs) -> list[str]:
    """The headline RL measures of every pair as a small text table."""
    rows = [["pair", *(label for _, label in RL_COLUMNS)]]
    for pair in pairs:
        a, b = pair["summary"]["frameworks"]
        values = pair["summary"]["rl_metrics"]
        rows.append([f"{a} vs {b}", *("n/a" if values.get(k) is None else f"{values[k]:.3g}" for k, _ in RL_COLUMNS)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
