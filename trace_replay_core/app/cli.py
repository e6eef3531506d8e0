"""The ``trace-replay`` command line (also ``python -m trace_replay_core``).

Subcommands:

- ``demo``: the built-in demonstration; needs no files (see :mod:`trace_replay_core.app.demo`).
- ``run --framework torch|jax --traces FILE --out FILE``: replay every request of a trace
  file through that framework's reference GPT-2 decode loop; write per request and token the
  token id, whether it was forced, its logprob, rank and the model's argmax, plus a summary.
- ``compare --traces FILE``: run both frameworks on the same requests and weights; write a
  JSON report of the per-position logprob differences and argmax divergences and a PNG plot.

Weights come from ``--seed`` (the tiny seeded model of :func:`~trace_replay_core.app.model.seeded_weights`,
default) or from ``--checkpoint DIR`` (Hugging Face GPT-2 layout). The framework is imported
only when a subcommand needs it. Exit status: 0 success; 1 a check failed (a traced request
not reproduced exactly, or a demo check); 2 bad arguments or input files (nothing is written).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from .model import GPT2Config, seeded_weights
from .progress import Progress
from .records import RequestResult, TraceRequest

__all__ = ["main", "build_parser", "load_loop", "check_device", "replay_requests", "result_to_json", "run_summary",
           "load_model", "CliError", "FRAMEWORKS"]

FRAMEWORKS = ("torch", "jax")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

RunDecode = Callable[..., List[RequestResult]]


class CliError(Exception):
    """A problem with the command's arguments or inputs, reported as one line (exit status 2)."""


# frameworks, devices, weights -----------------------------------------------------------------
def load_loop(framework: str) -> RunDecode:
    """The reference decode loop ``run_decode`` of ``framework`` (``"torch"`` or ``"jax"``),
    imported now; raises :class:`CliError` saying what to install if the framework is missing."""
    if framework not in FRAMEWORKS:
        raise CliError(f"framework must be one of {', '.join(FRAMEWORKS)} (got {framework!r})")
    try:
        module = importlib.import_module(f"trace_replay_{framework}.gpt2")
    except ImportError as exc:
        raise CliError(f"the {framework} decode loop cannot be imported ({exc}); install the framework, "
                       f"e.g. pip install 'trace-replay[{framework}]'") from None
    return module.run_decode


def check_device(framework: str, device: str) -> None:
    """Raise :class:`CliError` unless ``device`` (``cpu``, ``cuda`` or ``cuda:N``) is usable by
    ``framework``; imports the framework for ``cuda``."""
    if not _DEVICE.match(device):
        raise CliError(f"--device must be cpu, cuda or cuda:N (got {device!r})")
    if device == "cpu":
        return
    index = int(device.split(":")[1]) if ":" in device else 0
    if framework == "torch":
        torch = importlib.import_module("torch")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        jax = importlib.import_module("jax")
        try:
            count = len(jax.devices("gpu"))
        except RuntimeError:
            count = 0
    if index >= count:
        seen = f"sees {count} CUDA device{'s' if count != 1 else ''}" if count else "sees no CUDA device"
        raise CliError(f"--device {device}: {framework} {seen}; use --device cpu")


def load_model(checkpoint: Optional[str], seed: int) -> Tuple[GPT2Config, Dict[str, Any], Dict[str, Any]]:
    """``(config, weights, source)``: from the checkpoint folder if given, else the seeded tiny
    model; ``source`` describes where the weights came from (for output files)."""
    if checkpoint is not None:
        from .checkpoint import CheckpointError, load_checkpoint
        try:
            config, weights = load_checkpoint(checkpoint)
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        return config, weights, {"source": "checkpoint", "checkpoint": checkpoint}
    config = GPT2Config()
    return config, seeded_weights(config, seed), {"source": "seeded", "seed": seed}


def _read_traces(path: str, config: GPT2Config) -> List[TraceRequest]:
    from .traces import TraceFileError, read_traces
    try:
        return read_traces(path, config)
    except TraceFileError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"--traces {path}: cannot read ({exc.strerror or exc})") from None


# running ----------------------------------------------------------------------------------------
def replay_requests(framework: str, config: GPT2Config, weights: Mapping[str, Any],
                    requests: Sequence[TraceRequest], *, device: str = "cpu", max_batch: int = 8,
                    show_progress: Optional[bool] = None, loop: Optional[RunDecode] = None
                    ) -> Tuple[List[RequestResult], float]:
    """Run ``requests`` through ``framework``'s decode loop (or ``loop``); return the results
    (request order) and the wall-clock seconds of the call (weights upload, compilation and
    decoding; everything the loop does before it returns host arrays). A progress bar is drawn
    on stderr when ``show_progress`` is true, or when it is None and stderr is a terminal."""
    loop = loop if loop is not None else load_loop(framework)
    total = sum(r.new_tokens for r in requests)
    with Progress(total, framework, enabled=show_progress) as bar:
        t0 = time.perf_counter()
        results = loop(config, weights, requests, device=device, max_batch=max_batch, on_step=bar.update)
        seconds = time.perf_counter() - t0
    if len(results) != len(requests) or any(res.id != req.id for res, req in zip(results, requests, strict=True)):
        raise RuntimeError(f"the {framework} loop returned results that do not match the requests in order")
    return list(results), seconds


def _float(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def reproduced(request: TraceRequest, result: RequestResult) -> Optional[bool]:
    """Whether a traced request's tokens equal its trace (None for an untraced request)."""
    if request.trace is None:
        return None
    return [int(t) for t in result.tokens] == list(request.trace)


def result_to_json(request: TraceRequest, result: RequestResult) -> Dict[str, Any]:
    """One request of a ``run`` output file: ``id``, ``traced``, ``reproduced`` (traced
    requests: tokens equal the trace; null otherwise), ``prompt_len``, and per decoded token
    ``tokens``, ``forced``, ``logprobs`` (null where not finite), ``ranks``, ``argmax``."""
    return {"id": request.id, "traced": request.trace is not None, "reproduced": reproduced(request, result),
            "prompt_len": len(request.prompt),
            "tokens": [int(t) for t in result.tokens], "forced": [bool(f) for f in result.forced],
            "logprobs": [_float(x) for x in result.logprobs], "ranks": [int(r) for r in result.ranks],
            "argmax": [int(a) for a in result.argmax]}


def run_summary(requests: Sequence[TraceRequest], results: Sequence[RequestResult], seconds: float
                ) -> Dict[str, Any]:
    """Counts and rates of one run: requests, traced requests, tokens, forced tokens, seconds,
    tokens/s, exact reproductions (traced requests whose tokens equal their trace), and the
    mean logprob and rank of the forced tokens."""
    tokens = sum(len(r.tokens) for r in results)
    forced_lp = [float(lp) for r in results for lp, f in zip(r.logprobs, r.forced, strict=True) if f]
    forced_rank = [int(rk) for r in results for rk, f in zip(r.ranks, r.forced, strict=True) if f]
    traced = [(q, r) for q, r in zip(requests, results, strict=True) if q.trace is not None]
    return {"requests": len(requests), "traced_requests": len(traced), "tokens": tokens,
            "forced_tokens": len(forced_lp), "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "exact_reproductions": sum(bool(reproduced(q, r)) for q, r in traced),
            "mean_forced_logprob": _float(sum(forced_lp) / len(forced_lp)) if forced_lp else None,
            "mean_forced_rank": sum(forced_rank) / len(forced_rank) if forced_rank else None}


def _write_json_document(path: str, head: Dict[str, Any], key: str, rows: Sequence[Dict[str, Any]]) -> None:
    """``{**head, key: rows}`` as JSON with one row per line (atomically)."""
    from .traces import atomic_write
    with atomic_write(path) as f:
        f.write("{")
        for name, value in head.items():
            f.write(f"{json.dumps(name)}: {json.dumps(value, indent=1, allow_nan=False)},\n")
        f.write(f"{json.dumps(key)}: [\n")
        f.write(",\n".join(json.dumps(r, allow_nan=False, separators=(",", ":")) for r in rows))
        f.write("\n]}\n")


def _check_out_path(option: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a folder (give a file name)")


def _say(out: TextIO, quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=out)


# subcommands ------------------------------------------------------------------------------------
def cmd_run(args, out: TextIO) -> int:
    _check_out_path("--out", args.out)
    config, weights, source = load_model(args.checkpoint, args.seed)
    requests = _read_traces(args.traces, config)
    check_device(args.framework, args.device)
    loop = load_loop(args.framework)
    results, seconds = replay_requests(args.framework, config, weights, requests, device=args.device,
                                       max_batch=args.max_batch, show_progress=False if args.quiet else None,
                                       loop=loop)
    summary = run_summary(requests, results, seconds)
    head = {"summary": dict(summary, framework=args.framework, device=args.device, max_batch=args.max_batch,
                            traces=args.traces, weights=source, model=dataclasses.asdict(config))}
    rows = [result_to_json(q, r) for q, r in zip(requests, results, strict=True)]
    _write_json_document(args.out, head, "requests", rows)
    s = summary
    rate = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "n/a"
    _say(out, args.quiet, f"{args.framework} on {args.device}: {s['requests']} requests ({s['traced_requests']} "
                          f"traced), {s['tokens']} tokens in {s['seconds']:.2f} s ({rate} tokens/s)")
    if s["forced_tokens"]:
        _say(out, args.quiet, f"exact reproduction: {s['exact_reproductions']}/{s['traced_requests']} traced "
                              f"requests; forced tokens: mean logprob {s['mean_forced_logprob']:.3f}, "
                              f"mean rank {s['mean_forced_rank']:.1f}")
    _say(out, args.quiet, f"wrote {args.out}")
    if s["exact_reproductions"] != s["traced_requests"]:
        bad = [q.id for q, r in zip(requests, results, strict=True) if reproduced(q, r) is False]
        print(f"trace-replay run: {len(bad)} traced requests were not reproduced exactly: "
              f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}", file=sys.stderr)
        return 1
    return 0


def cmd_compare(args, out: TextIO) -> int:
    from .compare import compare_results, plot_divergence, summary_lines
    out_dir = args.out_dir
    report_path = args.report or os.path.join(out_dir, "compare_report.json")
    plot_path = args.plot or os.path.join(out_dir, "compare_divergence.png")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CliError(f"--out-dir {out_dir}: exists and is not a folder")
    for option, path in (("--report", report_path), ("--plot", plot_path)):
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(out_dir):   # out_dir is created later
            _check_out_path(option, path)
        elif os.path.isdir(path):
            raise CliError(f"{option} {path}: is a folder (give a file name)")
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("compare draws its plot with matplotlib, which is not installed: pip install matplotlib "
                       "(or the 'bench' extra: pip install 'trace-replay[bench]')")
    config, weights, source = load_model(args.checkpoint, args.seed)
    requests = _read_traces(args.traces, config)
    for fw in FRAMEWORKS:
        check_device(fw, args.device)
    loops = {fw: load_loop(fw) for fw in FRAMEWORKS}
    runs, summaries = {}, {}
    for fw in FRAMEWORKS:
        runs[fw], seconds = replay_requests(fw, config, weights, requests, device=args.device,
                                            max_batch=args.max_batch, show_progress=False if args.quiet else None,
                                            loop=loops[fw])
        summaries[fw] = run_summary(requests, runs[fw], seconds)
    report = compare_results(requests, runs["torch"], runs["jax"], names=FRAMEWORKS)
    report["summary"].update(device=args.device, max_batch=args.max_batch, traces=args.traces, weights=source,
                             model=dataclasses.asdict(config), runs=summaries)
    os.makedirs(out_dir, exist_ok=True)
    _write_json_document(report_path, {"summary": report["summary"], "per_position": report["per_position"]},
                         "requests", report["requests"])
    plot_divergence(report, plot_path)
    for line in summary_lines(report):
        _say(out, args.quiet, line)
    for fw in FRAMEWORKS:
        s = summaries[fw]
        _say(out, args.quiet, f"{fw}: {s['tokens']} tokens in {s['seconds']:.2f} s; exact reproduction "
                              f"{s['exact_reproductions']}/{s['traced_requests']} traced requests")
    _say(out, args.quiet, f"wrote {report_path} and {plot_path}")
    failed = [fw for fw in FRAMEWORKS if summaries[fw]["exact_reproductions"] != summaries[fw]["traced_requests"]]
    if failed:
        print(f"trace-replay compare: traced requests were not reproduced exactly by {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def cmd_demo(args, out: TextIO) -> int:
    from . import demo
    check_device("torch", args.device)
    check_device("jax", args.device)
    result = demo.run_demo(device=args.device, seed=args.seed, max_batch=args.max_batch,
                           show_progress=False if args.quiet else None)
    demo.report(result, quiet=args.quiet, out=out)
    return 0 if result.ok else 1


# parser -----------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return value


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N (got {text!r})")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trace-replay",
        description="Replay recorded token traces through reference GPT-2 decode loops in PyTorch and JAX.")
    sub = parser.add_subparsers(dest="command", metavar="{demo,run,compare}")
    sub.required = True

    def common(p, *, max_batch: int, model: bool = True):
        p.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N")
        p.add_argument("--max-batch", type=_positive, default=max_batch,
                       help=f"decode slots: requests decoded together (default {max_batch})")
        p.add_argument("--seed", type=int, default=0, help="seed of the tiny seeded model's weights (default 0)")
        if model:
            p.add_argument("--checkpoint", metavar="DIR",
                           help="Hugging Face GPT-2 folder (config.json + model.safetensors) instead of seeded weights")
        p.add_argument("--quiet", action="store_true", help="no progress bar; print nothing but errors"
                       if model else "no progress bar; print only the summary and the checks")

    demo = sub.add_parser("demo", help="replay a built-in set of traces in both frameworks and check them",
                          description="Run the torch and the JAX loop on the seeded tiny model with a built-in "
                                      "set of requests (traced with the model's own continuation, traced with "
                                      "random tokens, untraced; more requests than slots) and check that every "
                                      "trace is reproduced exactly and untraced requests are left alone.")
    common(demo, max_batch=4, model=False)

    run = sub.add_parser("run", help="replay a trace file through one framework's decode loop",
                         description="Replay every request of a trace file (JSON Lines) through the reference "
                                     "decode loop of one framework and write per-token results and a summary.")
    run.add_argument("--framework", required=True, choices=FRAMEWORKS)
    run.add_argument("--traces", required=True, metavar="FILE", help="trace file (JSON Lines)")
    run.add_argument("--out", required=True, metavar="FILE", help="output file (JSON)")
    common(run, max_batch=8)

    cmp = sub.add_parser("compare", help="run both frameworks on the same traces and compare logprobs",
                         description="Run the torch and the JAX loop on the same requests and weights; report "
                                     "per-position logprob differences and the first argmax divergence (JSON) "
                                     "and plot the divergence against position (PNG).")
    cmp.add_argument("--traces", required=True, metavar="FILE", help="trace file (JSON Lines)")
    cmp.add_argument("--out-dir", default=".", metavar="DIR",
                     help="folder for compare_report.json and compare_divergence.png (default: .)")
    cmp.add_argument("--report", metavar="FILE", help="report path (default: OUT_DIR/compare_report.json)")
    cmp.add_argument("--plot", metavar="FILE", help="plot path (default: OUT_DIR/compare_divergence.png)")
    common(cmp, max_batch=8)
    return parser


_COMMANDS = {"demo": cmd_demo, "run": cmd_run, "compare": cmd_compare}


def main(argv: Optional[Sequence[str]] = None, *, out: Optional[TextIO] = None) -> int:
    """Entry point of ``trace-replay``; returns the exit status (argparse exits with 2 on bad
    usage). ``out`` receives what would go to stdout (default ``sys.stdout``)."""
    args = build_parser().parse_args(argv)
    out = out if out is not None else sys.stdout
    try:
        return _COMMANDS[args.command](args, out)
    except CliError as exc:
        print(f"trace-replay {args.command}: error: {exc}", file=sys.stderr)
        return 2
