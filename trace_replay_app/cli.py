"""The ``trace-replay`` command line (also ``python -m trace_replay_app``).

Subcommands:

- ``demo``: the built-in demonstration; needs no files (see :mod:`trace_replay_app.demo`).
- ``run --framework torch|jax --traces FILE --out FILE``: replay every request of a trace
  file through that framework's decode loop of the model; write per request and token the
  token id, whether it was forced, its logprob, rank and the model's argmax, plus a summary.
- ``compare --traces FILE``: run both frameworks on the same requests and weights; write a
  JSON report of the per-position mismatch measures and a PNG plot (see
  :mod:`trace_replay_app.compare`).

The model: ``--model NAME`` (a registry family, seeded weights of its small default config from
``--seed``; default ``gpt2``) or ``--checkpoint DIR`` (a Hugging Face folder; the family from
its ``config.json``). ``--dtype`` sets the compute dtype (default float32 on the CPU, bfloat16
on a GPU); ``--temperature``/``--sampling-seed`` the sampling of untraced requests (0 = greedy).
A framework is imported only when a subcommand asks it about ``--device`` or runs its loop.
Before any work: the arguments, the output paths (none may replace an input or another output),
the trace file and the model's config, then each framework's view of the device, then the
weights (finite values only). Exit status: 0 success; 1 a check failed (a traced request not
reproduced exactly, a non-finite logprob, a demo check, a gate such as ``--max-k3``; the output
is written); 2 refused: bad arguments, inputs, output paths or device, or a run that does not
fit in the device's memory (one line on stderr; nothing is written); 130 interrupted (Ctrl-C,
however a framework reports it; nothing is written).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from trace_replay_core import split_device

from . import __version__, demo
from .models import FRAMEWORKS, families
from .records import DeviceMemoryError
from .runner import (
    CliError,
    check_outputs,
    decode_options,
    model_summary,
    prepare_run,
    replay_requests,
    reproduced,
    result_to_json,
    run_summary,
    say,
    stage,
    write_json_document,
)
from .schedule import COMPUTE_DTYPES
from .traces import interrupted, sigint_tracked

__all__ = ["main", "run", "build_parser", "cmd_run", "cmd_compare"]


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")


def _f(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


# subcommands ------------------------------------------------------------------------------------
def cmd_run(args, out: TextIO) -> int:
    check_outputs([("--out", args.out)], [("--traces", args.traces)], args.checkpoint)
    family, config, source, requests, weights, loops = prepare_run(args, [args.framework])
    decode = decode_options(args)
    results, seconds = replay_requests(
        args.framework,
        config,
        weights,
        requests,
        loop=loops[args.framework],
        device=args.device,
        max_batch=args.max_batch,
        show_progress=False if args.quiet else None,
        **decode,
    )
    s = run_summary(requests, results, seconds)
    head = {
        "summary": dict(
            s,
            framework=args.framework,
            device=args.device,
            max_batch=args.max_batch,
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
    if s["non_finite_logprobs"]:
        bad = s["requests_with_non_finite_logprobs"]
        print(
            f"trace-replay run: {s['non_finite_logprobs']} logprobs are not finite (written as null) in "
            f"{len(bad)} requests: {_ids(bad)}",
            file=sys.stderr,
        )
        status = 1
    return status


def cmd_compare(args, out: TextIO) -> int:
    from .compare import compare_results, gate_failures, output_paths, plot_divergence, summary_lines

    report_path, plot_path, create = output_paths(args.out_dir, args.report, args.plot, args.traces, args.checkpoint)
    family, config, source, requests, weights, loops = prepare_run(args, FRAMEWORKS)
    decode = decode_options(args)
    runs, summaries = {}, {}
    for fw in FRAMEWORKS:
        runs[fw], seconds = replay_requests(
            fw,
            config,
            weights,
            requests,
            loop=loops[fw],
            device=args.device,
            max_batch=args.max_batch,
            show_progress=False if args.quiet else None,
            **decode,
        )
        summaries[fw] = run_summary(requests, runs[fw], seconds)
    report = compare_results(requests, runs["torch"], runs["jax"], names=FRAMEWORKS)
    report["summary"].update(
        device=args.device,
        max_batch=args.max_batch,
        traces=args.traces,
        runs=summaries,
        **model_summary(family, config, source, decode),
    )
    if create is not None:
        os.makedirs(create, exist_ok=True)
    write_json_document(
        report_path,
        {"summary": report["summary"], "per_position": report["per_position"]},
        "requests",
        report["requests"],
    )
    try:
        plot_divergence(report, plot_path)
        wrote = f"wrote {report_path} and {plot_path}"
    except ImportError:
        wrote = f"wrote {report_path}; plot skipped: matplotlib is not installed (pip install matplotlib)"
    for line in summary_lines(report):
        say(out, args.quiet, line)
    for fw in FRAMEWORKS:
        s = summaries[fw]
        say(
            out,
            args.quiet,
            f"{fw}: {s['tokens']} tokens in {s['seconds']:.2f} s; exact reproduction "
            f"{s['exact_reproductions']}/{s['traced_requests']} traced requests",
        )
    say(out, args.quiet, wrote)
    status = 0
    failed = [fw for fw in FRAMEWORKS if summaries[fw]["exact_reproductions"] != summaries[fw]["traced_requests"]]
    if failed:
        print(
            f"trace-replay compare: traced requests were not reproduced exactly by {', '.join(failed)}", file=sys.stderr
        )
        status = 1
    bad = report["summary"]["requests_with_non_finite_logprobs"]
    if bad:
        print(f"trace-replay compare: {len(bad)} requests have non-finite logprobs: {_ids(bad)}", file=sys.stderr)
        status = 1
    if args.max_k3 is not None:
        above = gate_failures(report, "k3", args.max_k3)
        if above:
            print(
                f"trace-replay compare: {len(above)} requests fail --max-k3 {args.max_k3:g} (k3 KL estimate above it "
                f"or missing): {', '.join(above)}",
                file=sys.stderr,
            )
            status = 1
    return status


# parser -----------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (got {text!r})") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text!r})") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63) (got {value})")
    return value


def _device(text: str) -> str:
    try:
        split_device(text)  # the core's one device parser
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N (got {text!r})") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trace-replay",
        description="Replay recorded token traces through reference decode loops in PyTorch and JAX.",
    )
    parser.add_argument("--version", action="version", version=f"trace-replay {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,run,compare}")
    sub.required = True
    names = [f.name for f in families()]

    def common(p, *, max_batch: int, model: bool = True):
        p.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N")
        p.add_argument(
            "--max-batch",
            type=_positive,
            default=max_batch,
            help=f"decode slots: requests decoded together (default {max_batch})",
        )
        p.add_argument("--seed", type=_seed, default=0, help="seed of the seeded model's weights (default 0)")
        p.add_argument(
            "--model",
            choices=names,
            default=None,
            help="model family with seeded weights of a small default config (default gpt2)",
        )
        if model:
            p.add_argument(
                "--checkpoint",
                metavar="DIR",
                help="Hugging Face folder (config.json + model.safetensors or a sharded set with "
                "model.safetensors.index.json) instead of seeded weights; the family comes from "
                "its model_type",
            )
            p.add_argument(
                "--dtype",
                choices=COMPUTE_DTYPES,
                default=None,
                help="compute dtype (default float32 on the CPU, bfloat16 on a GPU)",
            )
            p.add_argument(
                "--temperature",
                type=_non_negative_float,
                default=0.0,
                help="sampling temperature of untraced requests (default 0: greedy)",
            )
            p.add_argument("--sampling-seed", type=_seed, default=0, help="seed of the sampling noise (default 0)")
        p.add_argument(
            "--quiet",
            action="store_true",
            help="no progress bar; print nothing but errors"
            if model
            else "no progress bar; print only the summary and the checks",
        )

    dm = sub.add_parser(
        "demo",
        help="replay a built-in set of traces in both frameworks and check them",
        description="Run the torch and the JAX loop on a seeded small model with a built-in "
        "set of requests (traced with the model's own continuation, traced with "
        "random tokens, untraced; more requests than slots) and check that every "
        "trace is reproduced exactly and untraced requests are left alone. With one "
        "framework installed, runs that one.",
    )
    common(dm, max_batch=4, model=False)

    run = sub.add_parser(
        "run",
        help="replay a trace file through one framework's decode loop",
        description="Replay every request of a trace file (JSON Lines) through the reference "
        "decode loop of one framework and write per-token results and a summary.",
    )
    run.add_argument("--framework", required=True, choices=FRAMEWORKS)
    run.add_argument("--traces", required=True, metavar="FILE", help="trace file (JSON Lines)")
    run.add_argument("--out", required=True, metavar="FILE", help="output file (JSON)")
    common(run, max_batch=8)

    cmp = sub.add_parser(
        "compare",
        help="run both frameworks on the same traces and compare logprobs",
        description="Run the torch and the JAX loop on the same requests and weights; report "
        "per request and overall the |logprob| and |probability| differences, the "
        "k3 KL estimate, the logprob correlation, argmax mismatches and the first "
        "divergence (JSON) and plot the difference against position (PNG).",
    )
    cmp.add_argument("--traces", required=True, metavar="FILE", help="trace file (JSON Lines)")
    cmp.add_argument(
        "--out-dir",
        default=None,
        metavar="DIR",
        help="folder for compare_report.json and compare_divergence.png (default: .); not with --report/--plot",
    )
    cmp.add_argument("--report", metavar="FILE", help="report path (default: OUT_DIR/compare_report.json)")
    cmp.add_argument("--plot", metavar="FILE", help="plot path (default: OUT_DIR/compare_divergence.png)")
    cmp.add_argument(
        "--max-k3",
        type=_non_negative_float,
        default=None,
        metavar="X",
        help="exit 1 and list the requests whose k3 KL estimate is above X or missing (not finite, none compared)",
    )
    common(cmp, max_batch=8)
    return parser


_COMMANDS = {"demo": demo.cmd_demo, "run": cmd_run, "compare": cmd_compare}


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of ``trace-replay``; returns the exit status (argparse exits with 2 on bad
    usage). ``out`` receives what would go to stdout (default ``sys.stdout``). Ctrl-C ends every
    subcommand with 130 however a framework wraps the interrupt (any error after a SIGINT is
    taken for it), and nothing is written."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = f"trace-replay {argv[0]}" if argv and argv[0] in _COMMANDS else "trace-replay"
    with sigint_tracked():
        try:
            stage("start")
            args = build_parser().parse_args(argv)
            return _COMMANDS[args.command](args, out if out is not None else sys.stdout)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) or (interrupted() and not isinstance(exc, SystemExit)):
                print(f"{name}: interrupted", file=sys.stderr)
                return 130
            if isinstance(exc, (CliError, DeviceMemoryError)):
                print(f"{name}: error: {exc}", file=sys.stderr)
                return 2
            raise


def run() -> NoReturn:
    """The process entry point (``trace-replay``, ``python -m trace_replay_app``): :func:`main`,
    then exit with its status.

    SIGINT is ignored outside :func:`main`'s own Ctrl-C handling (the statements before it and
    the exit after it), so that once the status is decided no Ctrl-C can turn it into a
    ``KeyboardInterrupt`` traceback. After a Ctrl-C (status 130) the process ends through
    ``os._exit`` once stdout and stderr are flushed, skipping the interpreter's shutdown as the
    default action of SIGINT does: CPython ends a ``python -m`` run by SIGINT, whatever its
    status, once a ``KeyboardInterrupt`` has passed through code run by ``exec`` or ``eval`` of
    a string, even one that was caught (dataclasses and named tuples build their methods so,
    over a thousand times while torch is imported). An interrupted command has nothing left to
    write."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = main()
    if status == 130:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(130)
    sys.exit(status)
