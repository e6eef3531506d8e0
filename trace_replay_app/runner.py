"""What the subcommands share: models and loops from the registry, the device check of each
framework, trace files in, runs with a progress bar, output documents out, and Ctrl-C. Host-only;
imports a framework only through an adapter asked about a device (:func:`check_framework_device`)
or through :meth:`~trace_replay_app.models.Family.run_decode` when a subcommand asks for a loop.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from trace_replay_core import parse_device, split_device

from .models import Family, FrameworkMissing, RunDecode, get_family
from .records import RequestResult, TraceRequest
from .rollouts import detect_format, read_rollouts
from .traces import TraceFileError, read_traces, stop_if_interrupted

__all__ = [
    "CliError",
    "load_loop",
    "check_framework_device",
    "load_model",
    "load_weights",
    "decode_options",
    "check_sampling_seed",
    "model_summary",
    "prepare_run",
    "read_requests",
    "progress_bar",
    "replay_requests",
    "check_out_path",
    "check_outputs",
    "say",
    "stage",
    "LOGPROBS_NOTE",
]

LOGPROBS_NOTE = "raw logits (before temperature)"


class CliError(Exception):
    """A problem with the command's arguments or inputs, reported as one line (exit status 2)."""


def load_loop(family: Family, framework: str, *, score: bool = False) -> RunDecode:
    """``family``'s decode loop (``score``: its teacher-forced ``run_score``) for ``framework``,
    imported now; :class:`CliError` saying what to install when it cannot be imported."""
    stage(f"{framework}-import")
    try:
        return family.run_score(framework) if score else family.run_decode(framework)
    except (FrameworkMissing, ValueError) as exc:
        raise CliError(str(exc)) from None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_device_error(device: str, version: str) -> str | None:
    """Why torch cannot use ``device``, from its installed metadata (a CPU build carries no CUDA
    requirement, or a ``+cpu`` label) and the CUDA driver's device count (the core's parser):
    the application imports a framework only in its loop modules."""
    label = version.partition("+")[2]  # "cpu", "cu130", ...; none on PyPI, whose Linux wheels require CUDA's
    needs = importlib.metadata.requires("torch") or []
    cuda_build = label.startswith(("cu", "rocm")) or (not label and any("nvidia-" in r or "cuda-" in r for r in needs))
    if not cuda_build:
        fix = f"pip uninstall -y torch && pip install 'torch=={version.partition('+')[0]}'"  # PyPI's Linux wheels
        return f"sees no CUDA device (its CPU build is installed; install its CUDA build: {fix})"
    if _driver_sees(device):
        return None
    count = _cuda_count()
    if not count:
        return "sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
    return f"sees CUDA devices {list(range(count))} only"


def _driver_sees(device: str) -> bool:
    try:
        parse_device(device)
    except ValueError:
        return False
    return True


def _cuda_count() -> int:
    """How many CUDA devices the driver shows this process, found through the core's parser in
    about 2 log2(count) questions (never one per index up to the one asked for)."""
    if not _driver_sees("cuda:0"):
        return 0
    low, high = 0, 1  # low is seen; high doubles until it is not
    while _driver_sees(f"cuda:{high}"):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _driver_sees(f"cuda:{middle}") else (low, middle)
    return high


def _jax_device_error(device: str, version: str) -> str | None:
    """Why JAX cannot use ``device``, asked through its adapter (which imports JAX)."""
    from trace_replay_jax import resolve_device

    try:
        resolve_device(device)
    except ValueError as exc:
        if "no gpu backend" not in str(exc):
            return f"cannot use it ({exc})"
        if _version("jax-cuda13-plugin") is None and _version("jax-cuda12-plugin") is None:
            fix = f"pip install 'jax[cuda13]=={version}'"
            return f"sees no CUDA device (its CPU build is installed; install its CUDA build: {fix})"
        return "sees no CUDA device (check the driver, CUDA_VISIBLE_DEVICES and JAX_PLATFORMS)"
    return None


def check_framework_device(framework: str, device: str) -> None:
    """Raise :class:`CliError` unless ``framework`` (``torch`` or ``jax``) can use ``device``
    (``cpu``, ``cuda`` or ``cuda:N``); the one-line message names the framework, the device, and
    the command that installs the framework's CUDA build when it has none. A framework that is not
    installed passes here (:func:`load_loop` says what to install)."""
    if split_device(device)[0] == "cpu":
        return
    stage(f"{framework}-import")
    version = _version(framework)
    if version is None:
        return
    why = (_torch_device_error if framework == "torch" else _jax_device_error)(device, version)
    if why is not None:
        raise CliError(f"--device {device}: {framework} {version} {why}; or use --device cpu")


def load_model(model: str | None, checkpoint: str | None, seed: int | None) -> tuple[Family, Any, dict[str, Any]]:
    """``(family, config, source)``: from the checkpoint folder's ``config.json`` if given, else
    the family ``model`` (default ``gpt2``) with its small default config and weights seeded by
    ``seed`` (default 0; refused beside a checkpoint, whose weights it would not change);
    ``source`` says where the weights come from (:func:`load_weights` reads them)."""
    from .checkpoint import CheckpointError, read_config  # reads safetensors only when asked

    if checkpoint is not None:
        if seed is not None:
            raise CliError(f"--seed {seed}: has no effect with --checkpoint (the weights are the checkpoint's)")
        try:
            family, config = read_config(checkpoint)
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        if model is not None and model != family.name:
            raise CliError(f"--model {model}: the checkpoint {checkpoint} holds a {family.name} model")
        return family, config, {"source": "checkpoint", "checkpoint": checkpoint}
    try:
        family = get_family(model or "gpt2")
    except ValueError as exc:
        raise CliError(f"--model: {exc}") from None
    return family, family.default_config(), {"source": "seeded", "seed": 0 if seed is None else seed}


def load_weights(family: Family, config: Any, source: Mapping[str, Any]) -> dict[str, Any]:
    """The weights :func:`load_model` named: the checkpoint's (every tensor checked, finite
    values only) or the seeded ones; :class:`CliError` naming the file and tensor at fault."""
    from .checkpoint import CheckpointError, load_checkpoint

    stage("load")
    if source["source"] == "seeded":
        return family.seeded_weights(config, source["seed"])
    try:
        return load_checkpoint(source["checkpoint"])[2]
    except CheckpointError as exc:
        raise CliError(str(exc)) from None


def read_requests(path: str, config: Any, *, format: str = "auto", requests_path: str | None = None) -> list:
    """The requests of a trace file (untraced requests allowed; a ``logprobs`` field ignored) or
    of a rollout file (:func:`~trace_replay_app.rollouts.read_rollouts`: ``format``, and the
    completions' request bodies ``requests_path``), checked against ``config``;
    :class:`CliError` naming the file, line and field."""
    try:
        if (detect_format(path) if format == "auto" else format) == "trace" and requests_path is None:
            return read_traces(path, config)
        return [r.request for r in read_rollouts(path, config, format=format, requests_path=requests_path)]
    except TraceFileError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        which = "--requests" if requests_path is not None and exc.filename == requests_path else "--traces"
        raise CliError(f"{which} {exc.filename or path}: cannot read ({exc.strerror or exc})") from None


def decode_options(args) -> dict:
    """The loop's ``dtype``/``temperature``/``seed``/``logprobs_mode`` from the arguments (dtype
    default: float32 on the CPU, bfloat16 on a GPU)."""
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    mode = getattr(args, "logprobs_mode", "raw_logprobs")
    seed = 0 if args.sampling_seed is None else args.sampling_seed
    return {"dtype": dtype, "temperature": args.temperature, "seed": seed, "logprobs_mode": mode}


def check_sampling_seed(args) -> None:
    """:class:`CliError` for ``--sampling-seed`` at temperature 0, where nothing is drawn."""
    if args.sampling_seed is not None and not args.temperature:
        seed = args.sampling_seed
        raise CliError(f"--sampling-seed {seed}: has no effect at --temperature 0 (greedy: nothing drawn)")


def model_summary(family, config, source, decode) -> dict:
    """The model and decoding part of an output's summary."""
    dataclass = dataclasses.is_dataclass(config) and not isinstance(config, type)
    sizes = dataclasses.asdict(config) if dataclass else dict(vars(config))
    mode = decode.get("logprobs_mode", "raw_logprobs")
    return {
        "family": family.name,
        "weights": source,
        "model": sizes,
        "dtype": decode["dtype"],
        "temperature": decode["temperature"],
        "sampling_seed": decode["seed"],
        "logprobs": LOGPROBS_NOTE if mode == "raw_logprobs" else "processed: logits / temperature",
        "logprobs_mode": mode,
    }


def prepare_run(args, frameworks: Sequence[str], *, score: bool = False, check: Callable[[Any], None] | None = None):
    """What ``run`` and ``score`` do before their work, cheapest check first: the model's config
    (and ``check(config)``: the command's own checks of it), the trace file against it, each
    framework's view of the device, the weights, the loops."""
    family, config, source = load_model(args.model, args.checkpoint, args.seed)
    if check is not None:
        check(config)
    requests = read_requests(args.traces, config, format=args.format, requests_path=args.requests)
    for fw in frameworks:
        check_framework_device(fw, args.device)
    weights = load_weights(family, config, source)
    loops = {fw: load_loop(family, fw, score=score) for fw in frameworks}
    stop_if_interrupted()  # a Ctrl-C that Python could not raise where it landed (an import's callbacks)
    return family, config, source, requests, weights, loops


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
    first = [True]

    with progress_bar(total, framework, enabled=show_progress) as bar:

        def on_step(k: int) -> None:
            stop_if_interrupted()  # a framework may have swallowed the KeyboardInterrupt: stop at the next step
            if first[0]:
                first[0] = False
                stage(f"{framework}-decode")
            bar.update(k)

        t0 = time.perf_counter()
        # slots follow the work: never more than there are requests to hold
        slots = max(1, min(max_batch, len(requests)))
        results = loop(config, weights, requests, device=device, max_batch=slots, on_step=on_step, **decode)
        seconds = time.perf_counter() - t0
    stop_if_interrupted()  # a framework may have swallowed the KeyboardInterrupt
    if len(results) != len(requests) or any(res.id != req.id for res, req in zip(results, requests, strict=True)):
        raise RuntimeError(f"the {framework} loop returned results that do not match the requests in order")
    return list(results), seconds


def check_out_path(option: str, path: str, *, inputs: Sequence[tuple[str, str | None]] = ()) -> None:
    """:class:`CliError` unless ``path`` can be written: its folder exists, it is no folder nor any ``inputs``."""
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


def check_outputs(
    outputs: Sequence[tuple[str, str]], inputs: Sequence[tuple[str, str | None]], checkpoint: str | None
) -> None:
    """:class:`CliError` before any work when an output (``(option, path)`` pairs) cannot be written,
    would replace an input (``inputs``, or a file of the ``checkpoint`` folder) or another output."""
    from .checkpoint import checkpoint_inputs

    every_input = [*inputs, *(("--checkpoint", f) for f in checkpoint_inputs(checkpoint))]
    seen: dict[str, str] = {}
    for option, path in outputs:
        check_out_path(option, path, inputs=every_input)
        real = os.path.realpath(path)
        if real in seen:
            raise CliError(f"{option} {path}: is also the {seen[real]} path (one output would replace the other)")
        seen[real] = option


def stage(name: str) -> None:
    """Say on stderr that the command reached ``name`` when ``TRACE_REPLAY_TEST_STAGES`` is set
    (tests interrupt the command at these points); nothing otherwise."""
    if os.environ.get("TRACE_REPLAY_TEST_STAGES"):
        print(f"trace-replay: stage {name}", file=sys.stderr, flush=True)
