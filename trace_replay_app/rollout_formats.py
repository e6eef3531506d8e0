"""The parsers of each rollout format: one decoded line -> the requests it holds (numpy-free).

Each parser takes the JSON value of one line (and, for ``openai-completions``, the request body
sent for it, if any) and returns :class:`~trace_replay_app.rollout_fields.Parsed` records; a
value that does not fit raises :class:`~trace_replay_app.rollout_fields.Invalid` naming its
field. :func:`detect` guesses a line's format from its top-level keys. The formats and the
engine sources of their field names are described in :mod:`trace_replay_app.rollouts`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .rollout_fields import (
    Invalid,
    Parsed,
    RequestBody,
    as_dict,
    as_list,
    integer,
    logprob,
    logprob_list,
    logprobs_mode,
    request_id,
    required,
    show,
    token_ids,
)
from .traces import PROMPT_FIELDS, TRACE_FIELDS, parse_request

__all__ = ["PARSERS", "detect", "parse_trace", "parse_completions", "parse_chat", "parse_sglang", "parse_vllm_offline"]

_PLACEHOLDER = re.compile(r"token_id:(-?[0-9]+)")
_NEEDS_IDS = 'request with "return_tokens_as_token_ids": true or "return_token_ids": true'


def _placeholder(text: Any, field: str, what: str) -> int:
    """The id of a ``"token_id:N"`` token string (vLLM's return_tokens_as_token_ids)."""
    if not isinstance(text, str):
        raise Invalid(field, f"{what} must be a string (got {show(text)})")
    match = _PLACEHOLDER.fullmatch(text)
    if match is None:
        raise Invalid(field, f'{what} is text ({show(text)}), not "token_id:N": {_NEEDS_IDS}')
    digits = match.group(1)
    if len(digits.lstrip("-")) > 10:
        raise Invalid(field, f"{what} {show(text)} is too large (at most 2**31 - 1)")
    return integer(int(digits), field, "token id", at=f" in {what}")


def _completion(
    ids: Any, ids_field: str, texts: list[tuple[Any, str, str]] | None, texts_field: str
) -> tuple[tuple[int, ...], str]:
    """The sampled ids of a choice: ``token_ids`` if given (checked against any "token_id:N"
    strings of ``texts``: (token, field, what) per position), else parsed from ``texts``."""
    if ids is not None:
        trace = token_ids(ids, ids_field)
        if texts is not None:
            if len(texts) != len(trace):
                raise Invalid(texts_field, f"holds {len(texts)} tokens but {ids_field} holds {len(trace)}")
            for tok, (text, field, what) in zip(trace, texts):
                if isinstance(text, str) and _PLACEHOLDER.fullmatch(text) and _placeholder(text, field, what) != tok:
                    raise Invalid(field, f"{what} is {text!r} but {ids_field} has {tok} there")
        return trace, ids_field
    if texts is None:
        raise Invalid(ids_field, f"missing: the response has no token ids ({_NEEDS_IDS}, and logprobs)")
    if not texts:
        raise Invalid(texts_field, "must not be empty (a rollout needs at least one sampled token)")
    return tuple(_placeholder(text, field, what) for text, field, what in texts), texts_field


def _index(choice: dict[str, Any], where: str) -> int:
    return integer(required(choice, "index", f"{where}.index"), f"{where}.index")


def _body_prompts(body: RequestBody) -> tuple[list[tuple[tuple[int, ...], str]], int]:
    """The prompts (token ids, field) and ``n`` of a completions request body."""
    try:
        obj = as_dict(body.obj, None)
        if obj.get("echo") is True:
            raise Invalid("echo", "a response to echo=true repeats the prompt in its tokens (not supported)")
        n = obj.get("n")
        n = 1 if n is None else integer(n, "n")
        if n < 1:
            raise Invalid("n", "must be at least 1")
        prompt = required(obj, "prompt", "prompt", "the request's prompt, as token ids")
        if isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt)):
            raise Invalid("prompt", "is text: a requests file must give each prompt as a list of token ids")
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [(token_ids(p, f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)], n
        return [(token_ids(prompt, "prompt"), "prompt")], n
    except Invalid as exc:
        raise Invalid(exc.field, exc.message, path=body.path, line=body.line) from None


def _choices(obj: Any, kind: str) -> tuple[dict[str, Any], str, list[Any]]:
    response = as_dict(obj, None)
    if response.get("object") is not None and response["object"] != kind:
        raise Invalid("object", f"is {show(response['object'])}, not {kind!r}")
    rid = request_id(required(response, "id", "id"), "id")
    choices = as_list(required(response, "choices", "choices"), "choices")
    if not choices:
        raise Invalid("choices", "must not be empty")
    return response, rid, choices


def parse_completions(obj: Any, body: RequestBody | None) -> list[Parsed]:
    """An OpenAI completions response (``object`` "text_completion") as vLLM/SGLang serve it."""
    response, rid, choices = _choices(obj, "text_completion")
    prompts, n = _body_prompts(body) if body is not None else ([], 1)
    if body is not None and len(choices) != len(prompts) * n:
        raise Invalid(
            "choices",
            f"holds {len(choices)} choices but the request on line {body.line} of {body.path} "
            f"asks for {len(prompts)} prompt(s) x n={n}",
        )
    out = []
    for pos, raw in enumerate(choices):
        where = f"choices[{pos}]"
        choice = as_dict(raw, where)
        index = _index(choice, where)
        texts, token_logprobs = None, None
        if choice.get("logprobs") is not None:
            logprobs = as_dict(choice["logprobs"], f"{where}.logprobs")
            tokens_field = f"{where}.logprobs.tokens"
            tokens = as_list(required(logprobs, "tokens", tokens_field), tokens_field)
            texts = [(text, tokens_field, f"entry {i}") for i, text in enumerate(tokens)]
            lp_field = f"{where}.logprobs.token_logprobs"
            token_logprobs = logprob_list(
                required(logprobs, "token_logprobs", lp_field), lp_field, len(tokens), tokens_field
            )
        trace, trace_field = _completion(
            choice.get("token_ids"), f"{where}.token_ids", texts, f"{where}.logprobs.tokens"
        )
        prompt_field = f"{where}.prompt_token_ids"
        prompt = (
            token_ids(choice["prompt_token_ids"], prompt_field) if choice.get("prompt_token_ids") is not None else None
        )
        prompt_at = None
        if body is not None:
            if index >= len(prompts) * n:
                raise Invalid(
                    f"{where}.index", f"{index} is beyond the {len(prompts) * n} choices the request asks for"
                )
            sent, sent_field = prompts[index // n]
            if prompt is not None and prompt != sent:
                raise Invalid(prompt_field, f'differs from "{sent_field}" on line {body.line} of {body.path}')
            if prompt is None:
                prompt, prompt_field, prompt_at = sent, sent_field, (body.path, body.line)
        if prompt is None:
            raise Invalid(
                prompt_field,
                "missing: a completions response carries the prompt's token ids only for a request with "
                '"return_token_ids": true; give the request bodies instead (requests_path=, one JSON line '
                'per response, "prompt" as token ids)',
            )
        out.append(
            Parsed(
                f"{rid}/{index}",
                f"{where}.index",
                prompt,
                prompt_field,
                trace,
                trace_field,
                token_logprobs,
                logprobs_mode(response, "logprobs_mode"),
                prompt_at,
            )
        )
    return out


def parse_chat(obj: Any, body: RequestBody | None = None) -> list[Parsed]:
    """An OpenAI chat completions response (``object`` "chat.completion") as vLLM serves it."""
    response, rid, choices = _choices(obj, "chat.completion")
    why = 'a chat response carries the prompt\'s token ids only for a request with "return_token_ids": true'
    prompt = token_ids(required(response, "prompt_token_ids", "prompt_token_ids", why), "prompt_token_ids")
    out = []
    for pos, raw in enumerate(choices):
        where = f"choices[{pos}]"
        choice = as_dict(raw, where)
        index = _index(choice, where)
        texts, values = None, None
        if choice.get("logprobs") is not None:
            logprobs = as_dict(choice["logprobs"], f"{where}.logprobs")
            content = as_list(required(logprobs, "content", f"{where}.logprobs.content"), f"{where}.logprobs.content")
            texts, values = [], []
            for i, raw_entry in enumerate(content):
                at = f"{where}.logprobs.content[{i}]"
                entry = as_dict(raw_entry, at)
                texts.append((required(entry, "token", f"{at}.token"), f"{at}.token", "the token"))
                values.append(logprob(required(entry, "logprob", f"{at}.logprob"), f"{at}.logprob"))
        trace, trace_field = _completion(
            choice.get("token_ids"), f"{where}.token_ids", texts, f"{where}.logprobs.content"
        )
        out.append(
            Parsed(
                f"{rid}/{index}",
                f"{where}.index",
                prompt,
                "prompt_token_ids",
                trace,
                trace_field,
                values,
                logprobs_mode(response, "logprobs_mode"),
            )
        )
    return out


def _sglang_entries(value: Any, field: str, *, output: bool) -> tuple[tuple[int, ...], list[float]]:
    entries = as_list(value, field, "a list of [logprob, token id, text] entries")
    if not entries:
        raise Invalid(field, "must not be empty")
    ids, logprobs = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) not in (2, 3):
            raise Invalid(field, f"entry {i} must be [logprob, token id, text] (got {show(entry)})")
        ids.append(integer(entry[1], field, "token id", at=f" in entry {i}"))
        if output:
            logprobs.append(logprob(entry[0], field, f"the logprob of entry {i}"))
    return tuple(ids), logprobs


def parse_sglang(obj: Any, body: RequestBody | None = None) -> list[Parsed]:
    """SGLang's native ``/generate`` output (one object, or a list for a batch or n > 1)."""
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise Invalid(None, "holds an empty list (no outputs)")
    out = []
    for k, item in enumerate(items):
        pre = f"[{k}]." if isinstance(obj, list) else ""
        output = as_dict(item, pre.rstrip(".") or None)
        meta = as_dict(required(output, "meta_info", f"{pre}meta_info"), f"{pre}meta_info")
        rid = request_id(required(meta, "id", f"{pre}meta_info.id"), f"{pre}meta_info.id")
        lp_field, ids_field = f"{pre}meta_info.output_token_logprobs", f"{pre}output_ids"
        trace, logprobs, trace_field = None, None, lp_field
        if meta.get("output_token_logprobs") is not None:
            trace, logprobs = _sglang_entries(meta["output_token_logprobs"], lp_field, output=True)
        if output.get("output_ids") is not None:
            ids = token_ids(output["output_ids"], ids_field)
            if trace is not None and ids != trace:
                raise Invalid(ids_field, f"differs from the token ids of {lp_field}")
            trace, trace_field = ids, ids_field
        if trace is None:
            raise Invalid(lp_field, "missing (request with return_logprob)")
        in_field = f"{pre}meta_info.input_token_logprobs"
        fix = "request with logprob_start_len=0 so that SGLang returns every prompt token"
        prompt, _ = _sglang_entries(required(meta, "input_token_logprobs", in_field, fix), in_field, output=False)
        count_field = f"{pre}meta_info.prompt_tokens"
        count = integer(required(meta, "prompt_tokens", count_field), count_field)
        if len(prompt) != count:
            raise Invalid(
                in_field, f"holds {len(prompt)} of the prompt's {count} tokens (meta_info.prompt_tokens): {fix}"
            )
        out.append(
            Parsed(
                rid,
                f"{pre}meta_info.id",
                prompt,
                in_field,
                trace,
                trace_field,
                logprobs,
                logprobs_mode(output, f"{pre}logprobs_mode"),
            )
        )
    return out


def parse_vllm_offline(obj: Any, body: RequestBody | None = None) -> list[Parsed]:
    """vLLM's offline ``RequestOutput`` written as JSON (``outputs`` of ``CompletionOutput``)."""
    output = as_dict(obj, None)
    rid = request_id(required(output, "request_id", "request_id"), "request_id")
    prompt = token_ids(required(output, "prompt_token_ids", "prompt_token_ids"), "prompt_token_ids")
    outputs = as_list(required(output, "outputs", "outputs"), "outputs")
    if not outputs:
        raise Invalid("outputs", "must not be empty")
    out = []
    for pos, raw in enumerate(outputs):
        where = f"outputs[{pos}]"
        completion = as_dict(raw, where)
        index = _index(completion, where)
        trace = token_ids(required(completion, "token_ids", f"{where}.token_ids"), f"{where}.token_ids")
        values = None
        if completion.get("logprobs") is not None:
            field = f"{where}.logprobs"
            positions = as_list(completion["logprobs"], field, "a list of {token id: Logprob} objects")
            if len(positions) != len(trace):
                raise Invalid(
                    field, f"holds {len(positions)} positions but {where}.token_ids holds {len(trace)} tokens"
                )
            values = []
            for i, (tok, raw_position) in enumerate(zip(trace, positions)):
                position = as_dict(raw_position, f"{field}[{i}]")
                if position.get(str(tok)) is None:
                    raise Invalid(f"{field}[{i}]", f"has no entry for the sampled token {tok}")
                entry = as_dict(position[str(tok)], f'{field}[{i}]["{tok}"]')
                at = f'{field}[{i}]["{tok}"].logprob'
                values.append(logprob(required(entry, "logprob", at), at))
        mode = logprobs_mode(output, "logprobs_mode")
        out.append(
            Parsed(
                f"{rid}/{index}",
                f"{where}.index",
                prompt,
                "prompt_token_ids",
                trace,
                f"{where}.token_ids",
                values,
                mode,
            )
        )
    return out


def parse_trace(obj: Any, body: RequestBody | None = None) -> list[Parsed]:
    """The project's trace line (see :mod:`trace_replay_app.traces`) with optional ``logprobs``."""
    line = as_dict(obj, None)
    if all(line.get(name) is None for name in TRACE_FIELDS):
        raise Invalid("trace", f"missing: a rollout needs its sampled tokens ({', '.join(TRACE_FIELDS)})")
    try:
        request = parse_request(line)
    except ValueError as exc:
        raise Invalid(getattr(exc, "field", None), getattr(exc, "message", str(exc))) from None
    assert request.trace is not None
    prompt_field = next(name for name in PROMPT_FIELDS if line.get(name) is not None)
    trace_field = next(name for name in TRACE_FIELDS if line.get(name) is not None)
    values = None
    if line.get("logprobs") is not None:
        values = logprob_list(line["logprobs"], "logprobs", len(request.trace), trace_field)
    for field, tokens in ((prompt_field, request.prompt), (trace_field, request.trace)):
        for i, tok in enumerate(tokens):
            integer(tok, field, "token id", at=f" at index {i}")
    return [
        Parsed(
            request.id,
            "id",
            request.prompt,
            prompt_field,
            request.trace,
            trace_field,
            values,
            logprobs_mode(line, "logprobs_mode"),
        )
    ]


PARSERS: dict[str, Callable[[Any, RequestBody | None], list[Parsed]]] = {
    "trace": parse_trace,
    "openai-completions": parse_completions,
    "openai-chat": parse_chat,
    "sglang": parse_sglang,
    "vllm-offline": parse_vllm_offline,
}


def detect(obj: Any) -> str | None:
    """The format a decoded line looks like (by its top-level keys), or None."""
    if isinstance(obj, list):
        return "sglang" if obj and isinstance(obj[0], dict) and "meta_info" in obj[0] else None
    if not isinstance(obj, dict):
        return None
    if "meta_info" in obj:
        return "sglang"
    if "outputs" in obj and ("request_id" in obj or "prompt_token_ids" in obj):
        return "vllm-offline"
    if "choices" in obj:
        kinds = {"text_completion": "openai-completions", "chat.completion": "openai-chat"}
        kind = kinds.get(obj["object"]) if isinstance(obj.get("object"), str) else None
        if kind is None and isinstance(obj["choices"], list) and obj["choices"] and isinstance(obj["choices"][0], dict):
            first = obj["choices"][0]
            kind = "openai-chat" if "message" in first else "openai-completions" if "text" in first else None
        return kind
    if any(name in obj for name in TRACE_FIELDS) or ("id" in obj and any(name in obj for name in PROMPT_FIELDS)):
        return "trace"
    return None
