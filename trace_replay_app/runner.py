"""What the subcommands share: models and loops from the registry, trace files in, runs with a
progress bar, output documents out. Host-only; imports no framework (loops load through
:meth:`~trace_replay_app.models.Family.run_decode` when a subcommand asks for one).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from trace_replay_core import parse_device

from .models import Family, FrameworkMissing, RunDecode, get_family
from .records import RequestResult, TraceRequest
from .traces import TraceFileError, atomic_write, read_traces

__all__ = [
    "CliError",
    "load_loop",
    "check_device",
    "load_model",
    "read_requests",
    "progress_bar",
    "replay_requests",
    "reproduced",
    "result_to_json",
    "run_summary",
    "write_json_document",
    "check_out_path",
    "say",
    "finite_or_none",
    "LOGPROBS_NOTE",
]

LOGPROBS_NOTE = "raw logits (before temperature)"


class CliError(Exception):
    """A problem with the command's arguments or inputs, reported as one line (exit status 2)."""


def load_loop(family: Family, framework: str) -> RunDecode:
    """``family``'s decode loop for ``framework``, imported now; :class:`CliError` saying what to
    install when it cannot be imported."""
    try:
        return family.run_decode(framework)
    except (FrameworkMissing, ValueError) as exc:
        raise CliError(str(exc)) from None


def check_device(framework: str, device: str) -> None:
    """Raise :class:`CliError` unless ``device`` (``cpu``, ``cuda`` or ``cuda:N``) exists here
    (asked through ``trace_replay_core.parse_device``; imports no framework)."""
    try:
        parse_device(device)
    except (TypeError, ValueError):
        if device == "cpu" or not (device == "cuda" or device.startswith("cuda:")):
            raise CliError(f"--device must be cpu, cuda or cuda:N (got {device!r})") from None
        raise CliError(
            f"--device {device}: {framework} sees no CUDA device{'' if device == 'cuda' else ' ' + device}"
            "; use --device cpu"
        ) from None


def load_model(
    model: str | None, checkpoint: str | None, seed: int
) -> tuple[Family, Any, dict[str, Any], dict[str, Any]]:
    """``(family, config, weights, source)``: from the checkpoint folder if given (the family
    from its ``config.json``), else the family ``model`` (default ``gpt2``) with its small
    default config and seeded weights; ``source`` says where the weights came from."""
    from .checkpoint import CheckpointError, load_checkpoint  # reads safetensors only when asked

    if checkpoint is not None:
        try:
            family, config, weights = load_checkpoint(checkpoint)
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        if model is not None and model != family.name:
            raise CliError(f"--model {model}: the checkpoint {checkpoint} holds a {family.name} model")
        return family, config, weights, {"source": "checkpoint", "checkpoint": checkpoint}
    try:
        family = get_family(model or "gpt2")
    except ValueError as exc:
        raise CliError(f"--model: {exc}") from None
    config = family.default_config()
    return family, config, family.seeded_weights(config, seed), {"source": "seeded", "seed": seed}


def read_requests(path: str, config: Any) -> list[TraceRequest]:
    """The trace file's requests, checked against ``config``; :class:`CliError` naming the file,
    line and field."""
    try:
        return read_traces(path, config)
    except TraceFileError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"--traces {path}: cannot read ({exc.strerror or exc})") from None


def progress_bar(
    total: int, label: str, *, enabled: bool | None = None, stream: TextIO | None = None, delay_s: float = 0.5
) -> tqdm:
    """A tqdm bar counting ``total`` decoded tokens under ``label`` on ``stream`` (stderr). It
    draws only when ``enabled`` is true, or when it is None and the stream is a terminal; not
    before ``delay_s`` (short runs print nothing); it erases itself when closed."""
    stream = stream if stream is not None else sys.stderr
    if enabled is None:
        isatty = getattr(stream, "isatty", None)
        enabled = bool(isatty and isatty())
    return tqdm(
        total=total,
        desc=label,
        unit="tok",
        file=stream,
        disable=not enabled,
        leave=False,
        delay=delay_s,
        mininterval=0.1,
        dynamic_ncols=True,
    )


def replay_requests(
    framework: str,
    config: Any,
    weights: Mapping[str, Any],
    requests: Sequence[TraceRequest],
    *,
    loop: RunDecode,
    device: str = "cpu",
    max_batch: int = 8,
    show_progress: bool | None = None,
    **decode: Any,
) -> tuple[list[RequestResult], float]:
    """Run ``requests`` through ``loop`` (a family's ``run_decode`` of ``framework``); return the
    results (request order) and the wall-clock seconds of the call (weights upload, compilation
    and decoding). ``decode``: ``dtype``, ``temperature``, ``seed`` for the loop. A progress bar
    is drawn on stderr when ``show_progress`` is true, or when it is None and stderr is a terminal."""
    total = sum(r.new_tokens for r in requests)
    with progress_bar(total, framework, enabled=show_progress) as bar:
        t0 = time.perf_counter()
        results = loop(config, weights, requests, device=device, max_batch=max_batch, on_step=bar.update, **decode)
        seconds = time.perf_counter() - t0
    if len(results) != len(requests) or any(res.id != req.id for res, req in zip(results, requests, strict=True)):
        raise RuntimeError(f"the {framework} loop returned results that do not match the requests in order")
    return list(results), seconds


def finite_or_none(x) -> float | None:
    """``float(x)``, or None when it is not finite (JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def reproduced(request: TraceRequest, result: RequestResult) -> bool | None:
    """Whether a traced request's tokens equal its trace (None for an untraced request)."""
    if request.trace is None:
        return None
    return [int(t) for t in result.tokens] == list(request.trace)


def result_to_json(request: TraceRequest, result: RequestResult) -> dict[str, Any]:
    """One request of a ``run`` output file: ``id``, ``traced``, ``reproduced`` (traced
    requests: tokens equal the trace; null otherwise), ``prompt_len``, and per decoded token
    ``tokens``, ``forced``, ``logprobs`` (null where not finite), ``ranks``, ``argmax``."""
    return {
        "id": request.id,
        "traced": request.trace is not None,
        "reproduced": reproduced(request, result),
        "prompt_len": len(request.prompt),
        "tokens": [int(t) for t in result.tokens],
        "forced": [bool(f) for f in result.forced],
        "logprobs": [finite_or_none(x) for x in result.logprobs],
        "ranks": [int(r) for r in result.ranks],
        "argmax": [int(a) for a in result.argmax],
    }


def run_summary(requests: Sequence[TraceRequest], results: Sequence[RequestResult], seconds: float) -> dict[str, Any]:
    """Counts and rates of one run: requests, traced requests, tokens, forced tokens, seconds,
    tokens/s, exact reproductions (traced requests whose tokens equal their trace), and the
    mean logprob and rank of the forced tokens."""
    tokens = sum(len(r.tokens) for r in results)
    forced_lp = [float(lp) for r in results for lp, f in zip(r.logprobs, r.forced, strict=True) if f]
    forced_rank = [int(rk) for r in results for rk, f in zip(r.ranks, r.forced, strict=True) if f]
    traced = [(q, r) for q, r in zip(requests, results, strict=True) if q.trace is not None]
    return {
        "requests": len(requests),
        "traced_requests": len(traced),
        "tokens": tokens,
        "forced_tokens": len(forced_lp),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "exact_reproductions": sum(bool(reproduced(q, r)) for q, r in traced),
        "mean_forced_logprob": finite_or_none(sum(forced_lp) / len(forced_lp)) if forced_lp else None,
        "mean_forced_rank": sum(forced_rank) / len(forced_rank) if forced_rank else None,
    }


def write_json_document(path: str, head: dict[str, Any], key: str, rows: Sequence[dict[str, Any]]) -> None:
    """``{**head, key: rows}`` as JSON with one row per line (atomically)."""
    with atomic_write(path) as f:
        f.write("{")
        for name, value in head.items():
            f.write(f"{json.dumps(name)}: {json.dumps(value, indent=1, allow_nan=False)},\n")
        f.write(f"{json.dumps(key)}: [\n")
        f.write(",\n".join(json.dumps(r, allow_nan=False, separators=(",", ":")) for r in rows))
        f.write("\n]}\n")


def check_out_path(option: str, path: str, *, inputs: Sequence[tuple[str, str]] = ()) -> None:
    """:class:`CliError` unless ``path`` can be written: its folder exists, it is not a folder,
    and it is none of ``inputs`` (``(option, path)`` pairs: an output must not replace an input)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a folder (give a file name)")
    for in_option, in_path in inputs:
        if in_path is not None and (os.path.realpath(path) == os.path.realpath(in_path)):
            raise CliError(f"{option} {path}: is the {in_option} file (the output would replace the input)")


def say(out: TextIO, quiet: bool, text: str) -> None:
    """Print ``text`` to ``out`` unless ``quiet``."""
    if not quiet:
        print(text, file=out)
