"""RL rollouts as inference engines write them: JSON Lines, one response per line -> requests to
replay, each with the logprobs the engine reported for its sampled tokens.

Formats (:data:`ROLLOUT_FORMATS`; field names as in the engine sources listed below):

- ``trace``: a line of :mod:`trace_replay_app.traces` plus an optional ``logprobs``: one float
  per trace token.
- ``openai-completions``: an OpenAI completions response as vLLM and SGLang serve it
  (``object`` "text_completion"); per choice, ``logprobs`` = {``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``}. Sampled ids come from the choice's ``token_ids`` (vLLM's
  ``return_token_ids``) or from ``tokens`` written as ``"token_id:N"`` (vLLM's
  ``return_tokens_as_token_ids``). The prompt's ids come from the choice's ``prompt_token_ids``
  (``return_token_ids``) or from the request bodies: a second JSON Lines file
  (``requests_path``), one body per response in the same order, ``prompt`` a list of token ids
  (or a list of such lists; choice ``i`` then belongs to prompt ``i // n``).
- ``openai-chat``: a chat completions response (``object`` "chat.completion"): per choice,
  ``logprobs.content`` = [{``token``, ``logprob``, ``bytes``, ``top_logprobs``}]; sampled ids
  from the choice's ``token_ids`` or ``"token_id:N"`` tokens, the prompt's ids from the
  top-level ``prompt_token_ids`` (vLLM's ``return_token_ids``; required).
- ``sglang``: SGLang's native ``/generate`` output with ``return_logprob``: ``meta_info``
  holds ``id``, ``prompt_tokens`` and ``output_token_logprobs`` / ``input_token_logprobs`` as
  [logprob, token id, text or null] entries (the first prompt entry's logprob is null); a batch
  or ``n`` > 1 answers a list of such objects, and a line may hold that list. SGLang writes no
  prompt ids field: they come from ``input_token_logprobs``, which covers the whole prompt only
  for a request with ``logprob_start_len=0`` (checked against ``prompt_tokens``). A top-level
  ``output_ids``, when present, must agree.
- ``vllm-offline``: vLLM's ``RequestOutput`` as JSON: ``request_id``, ``prompt_token_ids``,
  ``outputs`` = [{``index``, ``token_ids``, ``logprobs``}], ``logprobs`` one object per position
  keyed by token id, each value {``logprob``, ``rank``, ``decoded_token``}; the sampled token's
  entry gives that position's logprob.

A response with several choices (outputs) gives one request per choice, with id
``<response id>/<choice index>`` (``trace`` and ``sglang`` keep their own ids); ids must be
unique in the file. The request's trace is the sampled completion; its rollout logprobs are a
read-only float64 array, or None where the line has none (a trace line without ``logprobs``, a
response without ``logprobs``).

Values: token ids are non-negative integers (``bool`` is not one) up to 2**31 - 1, and, with a
``config``, below its ``vocab_size``, with prompt + completion within ``n_positions``, exactly
as :func:`trace_replay_app.traces.read_traces` checks. A logprob is a finite number <= 0:
0.0 and -0.0 (both occur for a token of probability 1) are accepted, and any positive value,
even 1e-7, is refused: the engines take logprobs from a log-softmax (or the log of a softmax,
whose entries are at most 1), which rounds to at most 0, so a positive value means the field
holds something else (logits, with vLLM's ``logprobs_mode`` "raw_logits"). vLLM's OpenAI
server writes -9999.0 for a logprob of -inf; that value is kept as it is. A line may record
``logprobs_mode`` (vLLM's names): "raw_logprobs" or "processed_logprobs" are kept on the
:class:`Rollout`, the logits modes are refused. An empty completion is refused, and so are
streamed chunks and a response to ``echo=true`` (its request body says so, or its tokens, which
then start with the prompt, have a null first logprob).

Rollout files are untrusted input: nothing in them is evaluated, every value is checked, and
every error is a :class:`~trace_replay_app.traces.TraceFileError` naming the file, the line
(from 1) and the field (a dotted path), e.g. ``out.jsonl, line 3, field
"choices[1].logprobs.token_logprobs": entry 4 is NaN``. A file with an error gives no rollouts.

Sources read for the field names (vllm-project/vllm, sgl-project/sglang):

- ``vllm/entrypoints/openai/completion/protocol.py``, ``.../completion/serving.py``: the
  completions request (``return_token_ids``, ``return_tokens_as_token_ids``, ``echo``),
  ``CompletionLogProbs``, the choice's ``token_ids`` / ``prompt_token_ids``, the -9999.0 clamp,
  and ``"token_id:{id}"`` (``format_token_id_placeholder``, ``vllm/entrypoints/generate/base/serving.py``);
- ``vllm/entrypoints/openai/chat_completion/protocol.py``, ``.../chat_completion/serving.py``:
  ``ChatCompletionLogProbsContent``, the top-level ``prompt_token_ids``, the choice's ``token_ids``;
- ``vllm/outputs.py``, ``vllm/logprobs.py``: ``RequestOutput``, ``CompletionOutput``, ``Logprob``;
  ``vllm/config/model.py``: ``logprobs_mode``;
- ``python/sglang/srt/managers/tokenizer_manager.py``: ``meta_info``, ``output_ids``, the
  [logprob, id, text] entries, a batch answered as a list;
  ``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput`` (``rid`` per sample,
  ``logprob_start_len``); ``python/sglang/srt/managers/scheduler_output_processor_mixin.py``:
  ``input_token_logprobs`` from ``logprob_start_len`` on, its first logprob null.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from .records import TraceRequest
from .rollout_fields import Invalid, Parsed, RequestBody
from .rollout_formats import PARSERS, detect
from .traces import TraceFileError, check_request, read_json_lines

__all__ = ["ROLLOUT_FORMATS", "Rollout", "read_rollouts", "detect_format"]

ROLLOUT_FORMATS = ("trace", "openai-completions", "openai-chat", "sglang", "vllm-offline")


@dataclasses.dataclass(frozen=True, eq=False)
class Rollout:
    """One sampled completion: the ``request`` to replay (its trace is the sampled token ids),
    the engine's ``logprobs`` of those tokens (read-only float64, one per trace token, or None),
    the ``logprobs_mode`` the line recorded (or None) and the ``line`` of the file it came from."""

    request: TraceRequest
    logprobs: np.ndarray | None
    logprobs_mode: str | None = None
    line: int = 0


def _first(path: str) -> tuple[int, Any]:
    for number, obj in read_json_lines(path):
        return number, obj
    raise TraceFileError(path, None, None, "holds no rollouts (one JSON response per line)")


def _shown(key: str) -> str:
    """A JSON key as an error message shows it: as is when printable (a control character would
    break the message's one line), else quoted with escapes; at most 40 characters."""
    text = key if key.isprintable() else repr(key)
    return text if len(text) <= 40 else text[:39] + "…"


def _guess(path: str, number: int, obj: Any) -> str:
    fmt = detect(obj)
    if fmt is None:
        keys = ", ".join(_shown(k) for k in sorted(obj)[:8]) if isinstance(obj, dict) else type(obj).__name__
        raise TraceFileError(
            path,
            number,
            None,
            f"cannot tell the rollout format from this line ({keys}); give one of {', '.join(ROLLOUT_FORMATS)}",
        )
    return fmt


def detect_format(path: str) -> str:
    """The format of the rollout file ``path`` (one of :data:`ROLLOUT_FORMATS`), told from the
    top-level keys of its first non-blank line; :class:`TraceFileError` if it cannot be told."""
    return _guess(path, *_first(path))


def _bodies(requests_path: str | None) -> Iterator[RequestBody | None]:
    if requests_path is None:
        while True:
            yield None
    for number, obj in read_json_lines(requests_path):
        yield RequestBody(requests_path, number, obj)


def _rollout(path: str, number: int, parsed: Parsed, config: Any | None) -> Rollout:
    request = TraceRequest(parsed.id, parsed.prompt, parsed.trace, len(parsed.trace))
    if config is not None:
        try:
            check_request(request, config, fields={"prompt": parsed.prompt_field, "trace": parsed.trace_field})
        except ValueError as exc:
            field = getattr(exc, "field", None)
            where = parsed.prompt_at if field == parsed.prompt_field and parsed.prompt_at else (path, number)
            raise TraceFileError(*where, field, getattr(exc, "message", str(exc))) from None
    logprobs = None
    if parsed.logprobs is not None:
        logprobs = np.array(parsed.logprobs, dtype=np.float64)
        logprobs.flags.writeable = False
    return Rollout(request, logprobs, parsed.logprobs_mode, number)


def read_rollouts(
    path: str, config: Any | None = None, *, format: str = "auto", requests_path: str | None = None
) -> list[Rollout]:
    """Every rollout of the file ``path``, in file order (choices in their order within a line).

    ``format`` is one of :data:`ROLLOUT_FORMATS`, or "auto" to tell it from the first line
    (:func:`detect_format`); every line must then fit that format. ``requests_path`` names the
    request bodies of an ``openai-completions`` file (one per response line, same order), for
    prompts the responses do not carry. With ``config`` (``vocab_size``, ``n_positions``) token
    ids and lengths are checked as :func:`~trace_replay_app.traces.read_traces` does. Raises
    :class:`TraceFileError` naming the file, line and field of the first problem (``ValueError``
    for an unknown ``format``; ``OSError`` if a file cannot be read); nothing is returned then.
    """
    if format != "auto" and format not in ROLLOUT_FORMATS:
        raise ValueError(f"unknown rollout format {format!r} (give auto or one of {', '.join(ROLLOUT_FORMATS)})")
    fmt = _guess(path, *_first(path)) if format == "auto" else format
    if requests_path is not None and fmt != "openai-completions":
        raise TraceFileError(
            requests_path, None, None, f"request bodies go with openai-completions responses, and {path} is {fmt}"
        )
    parse = PARSERS[fmt]
    bodies = _bodies(requests_path)
    rollouts: list[Rollout] = []
    first_line: dict[str, int] = {}
    responses = 0
    for number, obj in read_json_lines(path):
        responses += 1
        body = next(bodies, None)
        if requests_path is not None and body is None:
            raise TraceFileError(
                requests_path,
                None,
                None,
                f"ends after {responses - 1} request bodies, but line {number} of {path} "
                f"is response {responses}: give one body per response line, in the same order",
            )
        try:
            parsed = parse(obj, body)
        except Invalid as exc:
            raise TraceFileError(exc.path or path, exc.line or number, exc.field, exc.message) from None
        for item in parsed:
            if item.id in first_line:
                raise TraceFileError(
                    path, number, item.id_field, f"duplicate id {item.id!r} (first on line {first_line[item.id]})"
                )
            first_line[item.id] = number
            rollouts.append(_rollout(path, number, item, config))
    if requests_path is not None and next(bodies, None) is not None:
        raise TraceFileError(
            requests_path, None, None, f"holds more request bodies than the {responses} responses of {path}"
        )
    if not rollouts:
        raise TraceFileError(path, None, None, "holds no rollouts (one JSON response per line)")
    return rollouts
