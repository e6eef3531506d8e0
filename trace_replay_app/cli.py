"""The ``trace-replay`` command line (also ``python -m trace_replay_app``).

Subcommands:

- ``demo``: the built-in demonstration; needs no files (see :mod:`trace_replay_app.demo`).
- ``run --framework torch|jax --traces FILE --out FILE``: replay every request of a trace
  file through that framework's decode loop of the model; write per request and token the
  token id, whether it was forced, its logprob, rank and the model's argmax, plus a summary.
- ``score --framework torch|jax --traces FILE --out FILE``: the trainer's view, one
  teacher-forced forward over prompt + completion per request (:mod:`trace_replay_app.scoring`),
  written in ``run``'s format.
- ``compare [FILE ...] [--traces FILE] [--run FW,..] [--score FW,..]``: two or more sources of
  logprobs for the same requests (rollout files, outputs of run or score, runs made now;
  ``--traces FILE`` alone runs both frameworks' decode loops); the first against each other: a
  JSON report of the mismatch measures, those RL stacks log among them, and a PNG plot (see
  :mod:`trace_replay_app.compare`, :mod:`trace_replay_app.commands`).

``--traces`` (and compare's files) take the project's trace files and rollouts as engines write
them (``--format``, :mod:`trace_replay_app.rollouts`).

The model: ``--model NAME`` (a registry family, seeded weights of its small default config from
``--seed``; default ``gpt2``) or ``--checkpoint DIR`` (a Hugging Face folder; the family from
its ``config.json``). ``--dtype`` sets the compute dtype (default float32 on the CPU, bfloat16
on a GPU); ``--temperature``/``--sampling-seed`` the sampling of untraced requests (0 = greedy).
A framework is imported only when a subcommand asks it about ``--device`` or runs its loop.
Before any work: the arguments, the output paths (none may replace an input or another output),
the trace file and the model's config, then each framework's view of the device, then the
weights (finite values only). Exit status: 0 success; 1 a check failed (a traced request not
reproduced exactly, a non-finite logprob, a demo check, a gate such as ``--fail-above``; the
output is written); 2 refused: bad arguments, inputs, output paths or device, or a run that does not
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

from trace_replay_core import TOPK_MAX, split_device

from . import __version__, demo
from .commands import cmd_compare, cmd_run, cmd_score
from .models import FRAMEWORKS, families
from .records import DeviceMemoryError
from .rollouts import ROLLOUT_FORMATS
from .runner import CliError, stage
from .schedule import COMPUTE_DTYPES, LOGPROBS_MODES
from .traces import interrupted, sigint_tracked

__all__ = ["main", "run", "build_parser"]

TRACES_HELP = "trace or rollout file (JSON Lines; formats: see --format)"


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


def _top_k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {TOPK_MAX} (got {text!r})") from None
    if not 0 <= value <= TOPK_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {TOPK_MAX} (got {value})")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text!r})") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63) (got {value})")
    return value


def _gate(text: str) -> tuple[str, float]:
    """``METRIC=X`` of ``--fail-above`` -> ``(metric, X)``."""
    metric, sep, value = text.partition("=")
    try:
        limit = float(value)
    except ValueError:
        limit = float("nan")
    if not sep or not metric or not limit == limit or limit in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be METRIC=X with a finite number X (got {text!r})")
    return metric, limit


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
    sub = parser.add_subparsers(dest="command", metavar="{demo,run,score,compare}")
    sub.required = True
    names = [f.name for f in families()]

    def inputs(p, compare: bool = False):  # compare: options it may ignore default to None (commands.py)
        files = "--traces and the rollout files" if compare else "--traces"
        p.add_argument(
            "--format",
            choices=("auto", *ROLLOUT_FORMATS),
            default="auto",
            help=f"format of {files} (default auto: told from {'each' if compare else 'its'} first line)",
        )
        p.add_argument(
            "--requests",
            metavar="FILE",
            default=None,
            help=f"request bodies of {'the openai-completions file among ' if compare else ''}{files}"
            f"{'' if compare else ' (openai-completions)'}, for responses without prompt_token_ids "
            "(JSON Lines, one per response, same order, prompt as token ids)",
        )
        p.add_argument(
            "--logprobs-mode",
            choices=LOGPROBS_MODES,
            default=None if compare else "raw_logprobs",
            help="vLLM's names: raw_logprobs (default: of the logits as they are) or processed_logprobs "
            "(of logits / temperature; match the rollout's)",
        )

    def common(p, *, max_batch: int, model: bool = True, decode: bool = True, unset: bool = False):
        """``unset``: the run options default to None, so that the command sees which were given."""
        p.add_argument("--device", type=_device, default=None if unset else "cpu", help="cpu (default), cuda or cuda:N")
        if decode:
            p.add_argument(
                "--max-batch",
                type=_positive,
                default=None if unset else max_batch,
                help=f"decode slots: requests decoded together (default {max_batch})",
            )
        p.add_argument("--seed", type=_seed, default=None, help="seed of the seeded model's weights (default 0)")
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
        if model and decode:
            p.add_argument(
                "--temperature",
                type=_non_negative_float,
                default=None if unset else 0.0,
                help="sampling temperature of untraced requests (default 0: greedy)",
            )
            p.add_argument(
                "--sampling-seed",
                type=_seed,
                default=None,
                help="seed of the sampling noise (default 0; only with --temperature above 0)",
            )
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
    run.add_argument("--traces", required=True, metavar="FILE", help=TRACES_HELP)
    run.add_argument("--out", required=True, metavar="FILE", help="output file (JSON)")
    inputs(run)
    common(run, max_batch=8)

    sc = sub.add_parser(
        "score",
        help="score the completions of a trace or rollout file teacher-forced, as a trainer does",
        description="One forward over prompt + completion per request (batched, no KV cache): "
        "per completion token the logprob and rank of the raw logits and the greedy token, in "
        "the output format of run.",
    )
    sc.add_argument("--framework", required=True, choices=FRAMEWORKS)
    sc.add_argument("--traces", required=True, metavar="FILE", help=TRACES_HELP)
    sc.add_argument("--out", required=True, metavar="FILE", help="output file (JSON)")
    sc.add_argument(
        "--max-tokens", type=_positive, default=16384, help="padded tokens per forward batch (default 16384)"
    )
    sc.add_argument(
        "--chunk-rows",
        type=_positive,
        default=2048,
        help="positions whose logits exist at once: the output projection and the logprob op run "
        "this many at a time (default 2048)",
    )
    sc.add_argument(
        "--top-k",
        type=_top_k,
        default=0,
        metavar="K",
        help=f"also write each position's K most likely tokens and their logprobs (topk_ids, "
        f"topk_logprobs; at most {TOPK_MAX}; default 0: none)",
    )
    sc.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=None,
        help="with --logprobs-mode processed_logprobs (only): the logprobs of logits / T (default 1)",
    )
    inputs(sc)
    common(sc, max_batch=1, decode=False)

    cmp = sub.add_parser(
        "compare",
        help="compare the logprobs of the same requests from several sources",
        description="Compare two or more sources of logprobs for the same requests: rollout files "
        "(an engine's own logprobs), outputs of run or score, and runs made now (--run, --score; "
        "--traces FILE alone runs both frameworks' decode loops). The first source is the "
        "reference (the rollout's role), each other is compared with it: per request and overall "
        "the |logprob| and |probability| differences, the k3 KL estimate, argmax mismatches, the "
        "first divergence, and the measures RL stacks log (verl, prime-rl, slime) (JSON); the "
        "difference against position and the importance-ratio histogram (PNG).",
    )
    cmp.add_argument("sources", nargs="*", metavar="FILE", help="run or score outputs, rollout files")
    cmp.add_argument("--traces", metavar="FILE", help="requests for --run/--score (" + TRACES_HELP + ")")
    cmp.add_argument("--run", metavar="FW", help="decode with replay in these frameworks (torch,jax)")
    cmp.add_argument("--score", metavar="FW", help="score teacher-forced in these frameworks (torch,jax)")
    cmp.add_argument(
        "--fail-above",
        type=_gate,
        action="append",
        default=[],
        metavar="METRIC=X",
        help="exit 1 when a measure is above X or missing: a per-request one (k3, max_abs_logprob_diff, ...) "
        "for every request, or an rl_metrics key (e.g. verl/rollout_corr/k3_kl) for every pair; repeatable",
    )
    inputs(cmp, compare=True)
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
    common(cmp, max_batch=8, unset=True)
    return parser


_COMMANDS = {"demo": demo.cmd_demo, "run": cmd_run, "score": cmd_score, "compare": cmd_compare}


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
