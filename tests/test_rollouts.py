"""Rollout files as inference engines write them: every format read field by field, format
detection, one request per choice, request bodies for completions responses, and the refusal of
untrusted input (numpy only, no framework).

The example lines follow the engines' schemas (vLLM's OpenAI server and ``RequestOutput``,
SGLang's ``/generate``; the sources are listed in trace_replay_app/rollouts.py), with several
choices and logprobs that differ per token; the expected requests are written out by hand.
"""

import copy
import dataclasses
import json
import math
import re
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_replay_app.records import TraceRequest
from trace_replay_app.rollouts import ROLLOUT_FORMATS, Rollout, detect_format, read_rollouts
from trace_replay_app.traces import TraceFileError

CONFIG = types.SimpleNamespace(vocab_size=152064, n_positions=48)  # Qwen2.5's vocabulary, a short context
DROP = object()  # edit(): delete the key


def edit(example, *changes):
    """A deep copy of ``example`` with each (path, value) applied (``DROP`` deletes the key)."""
    out = copy.deepcopy(example)
    for path, value in changes:
        target = out
        for key in path[:-1]:
            target = target[key]
        if value is DROP:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return out


def write(tmp_path, *lines, name="rollouts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# Examples ----------------------------------------------------------------------------------------
TRACE = [
    {
        "id": "ep7-turn2",
        "prompt": [151644, 872, 198],
        "trace": [40, 1079, 151645],
        "logprobs": [-0.25, -1.5, -0.0],
        "logprobs_mode": "processed_logprobs",
    },
    {"id": 8, "prompt_token_ids": [5], "trace_token_ids": [6, 7], "reward": 1.0},
]

# vLLM /v1/completions with logprobs=1, return_token_ids and return_tokens_as_token_ids; n=2.
COMPLETIONS = {
    "id": "cmpl-8f3a",
    "object": "text_completion",
    "created": 1733000000,
    "model": "Qwen/Qwen2.5-0.5B",
    "choices": [
        {
            "index": 0,
            "text": " Paris.",
            "logprobs": {
                "text_offset": [0, 14, 22],
                "token_logprobs": [-0.03125, -1.75, -0.0],
                "tokens": ["token_id:12095", "token_id:13", "token_id:151643"],
                "top_logprobs": [
                    {"token_id:12095": -0.03125, "token_id:29215": -3.5},
                    {"token_id:13": -1.75},
                    {"token_id:151643": -0.0},
                ],
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [12095, 13, 151643],
            "prompt_logprobs": None,
            "prompt_token_ids": [785, 6722, 315, 9625, 374],
        },
        {
            "index": 1,
            "text": " Lyon",
            "logprobs": {
                "text_offset": [0, 14],
                "token_logprobs": [-3.5, -0.5],
                "tokens": ["token_id:29215", "token_id:151643"],
                "top_logprobs": [{"token_id:29215": -3.5, "token_id:12095": -0.03125}, {"token_id:151643": -0.5}],
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [29215, 151643],
            "prompt_logprobs": None,
            "prompt_token_ids": [785, 6722, 315, 9625, 374],
        },
    ],
    "usage": {"prompt_tokens": 10, "total_tokens": 15, "completion_tokens": 5},
}
# return_token_ids only: the tokens are text, the ids come from token_ids.
COMPLETIONS_TEXT = {
    "id": "cmpl-77c0",
    "object": "text_completion",
    "created": 1733000001,
    "model": "Qwen/Qwen2.5-0.5B",
    "choices": [
        {
            "index": 0,
            "text": " The sky",
            "logprobs": {
                "text_offset": [0, 4],
                "token_logprobs": [-0.625, -2.0],
                "tokens": [" The", " sky"],
                "top_logprobs": [{" The": -0.625}, {" sky": -2.0}],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [576, 12884],
            "prompt_token_ids": [9064, 374],
        }
    ],
    "usage": {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2},
}

CHAT_PROMPT = [151644, 872, 198, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198]


def _chat_entry(token_id, logprob):
    token = f"token_id:{token_id}"
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode())}],
    }


# vLLM /v1/chat/completions with logprobs, return_token_ids and return_tokens_as_token_ids; n=2.
CHAT = {
    "id": "chatcmpl-b21e",
    "object": "chat.completion",
    "created": 1733000100,
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "4", "refusal": None, "reasoning": None},
            "logprobs": {"content": [_chat_entry(19, -0.0002), _chat_entry(151645, -0.0)]},
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [19, 151645],
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "5", "refusal": None, "reasoning": None},
            "logprobs": {"content": [_chat_entry(20, -8.25), _chat_entry(151645, -0.125)]},
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [20, 151645],
        },
    ],
    "usage": {"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4},
    "prompt_logprobs": None,
    "prompt_token_ids": CHAT_PROMPT,
}
# Without logprobs: the ids come from token_ids, the rollout has no logprobs.
CHAT_NO_LOGPROBS = {
    "id": "chatcmpl-0c9d",
    "object": "chat.completion",
    "created": 1733000101,
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [9707, 0, 1],
        }
    ],
    "usage": {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3},
    "prompt_token_ids": [151644, 9707],
}

SGLANG_PROMPT = [[None, 785, None], [-7.5, 12884, None], [-2.25, 374, None], [-0.875, 279, None]]
# SGLang /generate with return_logprob, logprob_start_len=0 and n=2 (a list of two outputs).
SGLANG = [
    {
        "text": " blue.",
        "output_ids": [6303, 13],
        "meta_info": {
            "id": "7d1e_0",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 4,
            "weight_version": "default",
            "total_retractions": 0,
            "input_token_logprobs": SGLANG_PROMPT,
            "output_token_logprobs": [[-0.4375, 6303, None], [-1.125, 13, None]],
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.051,
        },
    },
    {
        "text": " clear",
        "output_ids": [2797, 151643],
        "meta_info": {
            "id": "7d1e_1",
            "finish_reason": {"type": "stop", "matched": 151643},
            "prompt_tokens": 4,
            "weight_version": "default",
            "total_retractions": 0,
            "input_token_logprobs": SGLANG_PROMPT,
            "output_token_logprobs": [[-1.25, 2797, " clear"], [-0.0, 151643, "<|endoftext|>"]],
            "completion_tokens": 2,
            "cached_tokens": 4,
            "e2e_latency": 0.049,
        },
    },
]
# One output as a plain object, without output_ids (older SGLang).
SGLANG_SINGLE = {
    "text": "!",
    "meta_info": {
        "id": "a41",
        "finish_reason": {"type": "length", "length": 1},
        "prompt_tokens": 2,
        "input_token_logprobs": [[None, 9707, None], [-3.0, 0, None]],
        "output_token_logprobs": [[-0.0625, 0, None]],
        "completion_tokens": 1,
        "cached_tokens": 0,
    },
}


def _lp(logprob, rank, text):
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


# vLLM LLM.generate(..., SamplingParams(n=2, logprobs=1)): a RequestOutput written as JSON. The
# sampled token is not the first key everywhere, and not always rank 1.
VLLM = {
    "request_id": "17",
    "prompt": "The sky is",
    "prompt_token_ids": [785, 12884, 374],
    "encoder_prompt": None,
    "encoder_prompt_token_ids": None,
    "prompt_logprobs": None,
    "outputs": [
        {
            "index": 0,
            "text": " blue.",
            "token_ids": [6303, 13],
            "cumulative_logprob": -0.5625,
            "logprobs": [
                {"6303": _lp(-0.4375, 1, " blue"), "2797": _lp(-1.25, 2, " clear")},
                {"13": _lp(-0.125, 1, ".")},
            ],
            "finish_reason": "length",
            "stop_reason": None,
        },
        {
            "index": 1,
            "text": " clear,",
            "token_ids": [2797, 11],
            "cumulative_logprob": -4.25,
            "logprobs": [
                {"6303": _lp(-0.4375, 1, " blue"), "2797": _lp(-1.25, 2, " clear")},
                {"13": _lp(-0.125, 1, "."), "11": _lp(-3.0, 4, ",")},
            ],
            "finish_reason": "length",
            "stop_reason": None,
        },
    ],
    "finished": True,
    "num_cached_tokens": 0,
}
VLLM_NO_LOGPROBS = {
    "request_id": 18,
    "prompt_token_ids": [9707],
    "outputs": [{"index": 0, "text": "abc", "token_ids": [0, 1, 2], "cumulative_logprob": None, "logprobs": None}],
    "logprobs_mode": "raw_logprobs",
}

EXAMPLES = {
    "trace": TRACE,
    "openai-completions": [COMPLETIONS, COMPLETIONS_TEXT],
    "openai-chat": [CHAT, CHAT_NO_LOGPROBS],
    "sglang": [SGLANG, SGLANG_SINGLE],
    "vllm-offline": [VLLM, VLLM_NO_LOGPROBS],
}
# format -> (id, prompt, trace, max_new_tokens, logprobs, logprobs_mode, line) per rollout
EXPECTED = {
    "trace": [
        ("ep7-turn2", (151644, 872, 198), (40, 1079, 151645), 3, [-0.25, -1.5, -0.0], "processed_logprobs", 1),
        ("8", (5,), (6, 7), 2, None, None, 2),
    ],
    "openai-completions": [
        ("cmpl-8f3a/0", (785, 6722, 315, 9625, 374), (12095, 13, 151643), 3, [-0.03125, -1.75, -0.0], None, 1),
        ("cmpl-8f3a/1", (785, 6722, 315, 9625, 374), (29215, 151643), 2, [-3.5, -0.5], None, 1),
        ("cmpl-77c0/0", (9064, 374), (576, 12884), 2, [-0.625, -2.0], None, 2),
    ],
    "openai-chat": [
        ("chatcmpl-b21e/0", tuple(CHAT_PROMPT), (19, 151645), 2, [-0.0002, -0.0], None, 1),
        ("chatcmpl-b21e/1", tuple(CHAT_PROMPT), (20, 151645), 2, [-8.25, -0.125], None, 1),
        ("chatcmpl-0c9d/0", (151644, 9707), (9707, 0, 1), 3, None, None, 2),
    ],
    "sglang": [
        ("7d1e_0", (785, 12884, 374, 279), (6303, 13), 2, [-0.4375, -1.125], None, 1),
        ("7d1e_1", (785, 12884, 374, 279), (2797, 151643), 2, [-1.25, -0.0], None, 1),
        ("a41", (9707, 0), (0,), 1, [-0.0625], None, 2),
    ],
    "vllm-offline": [
        ("17/0", (785, 12884, 374), (6303, 13), 2, [-0.4375, -0.125], None, 1),
        ("17/1", (785, 12884, 374), (2797, 11), 2, [-1.25, -3.0], None, 1),
        ("18/0", (9707,), (0, 1, 2), 3, None, "raw_logprobs", 2),
    ],
}


def fields(rollout):
    r = rollout.request
    logprobs = None if rollout.logprobs is None else rollout.logprobs.tolist()
    return (r.id, r.prompt, r.trace, r.max_new_tokens, logprobs, rollout.logprobs_mode, rollout.line)


# Reading ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ROLLOUT_FORMATS)
def test_each_format_is_read_field_by_field(tmp_path, fmt):
    path = write(tmp_path, *EXAMPLES[fmt])
    for how in (fmt, "auto"):
        rollouts = read_rollouts(path, CONFIG, format=how)
        assert [fields(r) for r in rollouts] == EXPECTED[fmt]
        assert read_rollouts(path, format=how)[0].request == rollouts[0].request  # no config: same requests
        for r in rollouts:
            assert isinstance(r, Rollout) and isinstance(r.request, TraceRequest)
            assert r.request.new_tokens == len(r.request.trace)
            if r.logprobs is not None:
                assert r.logprobs.dtype == np.float64 and r.logprobs.shape == (len(r.request.trace),)
                assert not r.logprobs.flags.writeable


@pytest.mark.parametrize("fmt", ROLLOUT_FORMATS)
def test_the_format_is_told_from_the_first_line(tmp_path, fmt):
    path = write(tmp_path, "", "  ", *EXAMPLES[fmt])
    assert detect_format(path) == fmt
    assert [fields(r)[:4] for r in read_rollouts(path)] == [e[:4] for e in EXPECTED[fmt]]


def test_a_completion_without_object_is_told_by_its_choices(tmp_path):
    completions = edit(COMPLETIONS, (("object",), DROP))
    chat = edit(CHAT, (("object",), DROP))
    assert detect_format(write(tmp_path, completions, name="c.jsonl")) == "openai-completions"
    assert detect_format(write(tmp_path, chat, name="h.jsonl")) == "openai-chat"


def test_each_choice_is_a_request_named_by_its_index(tmp_path):
    swapped = edit(COMPLETIONS, (("choices",), COMPLETIONS["choices"][::-1]))
    rollouts = read_rollouts(write(tmp_path, swapped), CONFIG)
    assert [r.request.id for r in rollouts] == ["cmpl-8f3a/1", "cmpl-8f3a/0"]
    assert [r.request.trace for r in rollouts] == [(29215, 151643), (12095, 13, 151643)]
    assert [r.logprobs.tolist() for r in rollouts] == [[-3.5, -0.5], [-0.03125, -1.75, -0.0]]


def test_zero_and_clamped_logprobs_are_kept(tmp_path):
    """0.0 and -0.0 (a certain token) and vLLM's -9999.0 (its stand-in for -inf) are logprobs;
    an integer is read as its float."""
    line = edit(TRACE[0], (("logprobs",), [0.0, -9999.0, -3]))
    (rollout,) = read_rollouts(write(tmp_path, line), CONFIG)
    assert rollout.logprobs.tolist() == [0.0, -9999.0, -3.0]
    assert math.copysign(1.0, read_rollouts(write(tmp_path, TRACE[0]))[0].logprobs[2]) == -1.0


def test_a_rollout_is_frozen_and_its_logprobs_read_only(tmp_path):
    (rollout, _) = read_rollouts(write(tmp_path, *TRACE))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.logprobs = None
    with pytest.raises(ValueError, match="read-only"):
        rollout.logprobs[0] = 0.0


# Request bodies for completions responses without prompt ids ------------------------------------
def _placeholder_choice(index, ids, logprobs):
    tokens = [f"token_id:{t}" for t in ids]
    return {
        "index": index,
        "text": "",
        "logprobs": {
            "text_offset": list(range(len(ids))),
            "token_logprobs": logprobs,
            "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)],
        },
        "finish_reason": "length",
        "stop_reason": None,
    }


# return_tokens_as_token_ids without return_token_ids: no token_ids, no prompt_token_ids.
RESPONSES = [
    {
        "id": "cmpl-r1",
        "object": "text_completion",
        "model": "m",
        "choices": [_placeholder_choice(0, [11, 12], [-0.5, -0.25]), _placeholder_choice(1, [13], [-4.0])],
    },
    {
        "id": "cmpl-r2",
        "object": "text_completion",
        "model": "m",
        "choices": [_placeholder_choice(0, [21], [-1.0]), _placeholder_choice(1, [22, 23], [-2.0, -3.0])],
    },
]
BODIES = [
    {
        "model": "m",
        "prompt": [785, 6722, 315],
        "n": 2,
        "max_tokens": 2,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    },
    {"model": "m", "prompt": [[40, 41], [50]], "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": True},
]


# Two prompts, n=2: vLLM numbers the choices prompt by prompt, so choices 0, 1 answer the first.
RESPONSE_BATCH = {
    "id": "cmpl-r3",
    "object": "text_completion",
    "model": "m",
    "choices": [_placeholder_choice(i, [31 + i], [-0.125 * (i + 1)]) for i in range(4)],
}
BODY_BATCH = {"model": "m", "prompt": [[60], [70, 71]], "n": 2, "max_tokens": 1, "logprobs": 0}


def test_prompts_come_from_the_request_bodies(tmp_path):
    responses = write(tmp_path, RESPONSES[0], "", RESPONSES[1], RESPONSE_BATCH, name="responses.jsonl")
    bodies = write(tmp_path, *BODIES, BODY_BATCH, name="requests.jsonl")
    rollouts = read_rollouts(responses, CONFIG, requests_path=bodies)
    assert [fields(r) for r in rollouts] == [
        ("cmpl-r1/0", (785, 6722, 315), (11, 12), 2, [-0.5, -0.25], None, 1),
        ("cmpl-r1/1", (785, 6722, 315), (13,), 1, [-4.0], None, 1),
        ("cmpl-r2/0", (40, 41), (21,), 1, [-1.0], None, 3),
        ("cmpl-r2/1", (50,), (22, 23), 2, [-2.0, -3.0], None, 3),
        ("cmpl-r3/0", (60,), (31,), 1, [-0.125], None, 4),
        ("cmpl-r3/1", (60,), (32,), 1, [-0.25], None, 4),
        ("cmpl-r3/2", (70, 71), (33,), 1, [-0.375], None, 4),
        ("cmpl-r3/3", (70, 71), (34,), 1, [-0.5], None, 4),
    ]


def test_prompt_ids_in_the_response_must_match_the_body(tmp_path):
    responses = write(tmp_path, COMPLETIONS, name="responses.jsonl")
    body = {"prompt": [785, 6722, 315, 9625, 374], "n": 2}
    assert len(read_rollouts(responses, requests_path=write(tmp_path, body, name="ok.jsonl"))) == 2
    bodies = write(tmp_path, edit(body, (("prompt", 4), 375)), name="requests.jsonl")
    message = f'^{re.escape(responses)}, line 1, field "choices\\[0\\]\\.prompt_token_ids": differs from "prompt" on '
    with pytest.raises(TraceFileError, match=message + f"line 1 of {re.escape(bodies)}$"):
        read_rollouts(responses, requests_path=bodies)


# id -> (bodies, anchored regex with {req} and {resp} for the two files' names)
BAD_BODIES = {
    "fewer": (
        BODIES[:1],
        r"^{req}: ends after 1 request bodies, but line 2 of {resp} is response 2: give one body per response "
        r"line, in the same order$",
    ),
    "more": (BODIES + BODIES[:1], r"^{req}: holds more request bodies than the 2 responses of {resp}$"),
    "text_prompt": (
        [edit(BODIES[0], (("prompt",), "The capital of France is")), BODIES[1]],
        r'^{req}, line 1, field "prompt": is text: a requests file must give each prompt as a list of token ids$',
    ),
    "beyond_vocab": (
        [BODIES[0], edit(BODIES[1], (("prompt", 1), [152064]))],
        r'^{req}, line 2, field "prompt\[1\]": token id 152064 at index 0 is not below the model\'s vocab_size 152064$',
    ),
    "negative": (
        [edit(BODIES[0], (("prompt", 0), -785)), BODIES[1]],
        r'^{req}, line 1, field "prompt": token id -785 at index 0 is negative$',
    ),
    "missing_prompt": (
        [edit(BODIES[0], (("prompt",), DROP)), BODIES[1]],
        r'^{req}, line 1, field "prompt": missing: the request\'s prompt, as token ids$',
    ),
    "choice_count": (
        [edit(BODIES[0], (("n",), 3)), BODIES[1]],
        r'^{resp}, line 1, field "choices": holds 2 choices but the request on line 1 of {req} asks for 1 '
        r"prompt\(s\) x n=3$",
    ),
    "n_not_int": (
        [edit(BODIES[0], (("n",), True)), BODIES[1]],
        r'^{req}, line 1, field "n": must be an integer \(got True\)$',
    ),
    "echo": (
        [edit(BODIES[0], (("echo",), True)), BODIES[1]],
        r'^{req}, line 1, field "echo": a response to echo=true repeats the prompt in its tokens \(not supported\)$',
    ),
    "not_json": ([BODIES[0], '{"prompt": [1'], r"^{req}, line 2: not valid JSON \(.*\)$"),
    "not_object": ([BODIES[0], "[40, 41]"], r"^{req}, line 2: must be a JSON object \(got list\)$"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_request_bodies_are_refused(tmp_path, case):
    bodies, pattern = BAD_BODIES[case]
    responses = write(tmp_path, *RESPONSES, name="responses.jsonl")
    requests = write(tmp_path, *bodies, name="requests.jsonl")
    with pytest.raises(TraceFileError, match=pattern.format(req=re.escape(requests), resp=re.escape(responses))):
        read_rollouts(responses, CONFIG, requests_path=requests)


def test_request_bodies_go_only_with_completions(tmp_path):
    responses = write(tmp_path, CHAT, name="responses.jsonl")
    requests = write(tmp_path, {"messages": [{"role": "user", "content": "2+2?"}]}, name="requests.jsonl")
    pattern = f"^{re.escape(requests)}: request bodies go with openai-completions responses, and "
    with pytest.raises(TraceFileError, match=pattern + f"{re.escape(responses)} is openai-chat$"):
        read_rollouts(responses, requests_path=requests)


def test_an_unknown_format_name_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="^unknown rollout format 'openai'"):
        read_rollouts(write(tmp_path, *TRACE), format="openai")


# Untrusted input ----------------------------------------------------------------------------------
S0 = SGLANG[0]
LOGITS = "the values are logits, not logprobs \\(give raw_logprobs or processed_logprobs\\)"
NEEDS_IDS = r'request with "return_tokens_as_token_ids": true or "return_token_ids": true'
HUGE_INT = "-1" + "0" * 400


def raw(example, *changes, **literals):
    """``edit`` as a JSON line, with each ``"@NAME@"`` string replaced by ``literals[NAME]``."""
    text = json.dumps(edit(example, *changes))
    for name, literal in literals.items():
        text = text.replace(f'"@{name}@"', literal)
    return text


def _cases():
    cases = {f"{fmt}/not_json": (fmt, [json.dumps(EXAMPLES[fmt][0])[:-3]], r"line 1: not valid JSON \(.*\)$")
             for fmt in ROLLOUT_FORMATS}  # fmt: skip
    tr, co, ch, sg, vl = "trace", "openai-completions", "openai-chat", "sglang", "vllm-offline"
    t0 = TRACE[0]
    C, CH, V = COMPLETIONS, CHAT, VLLM
    no_ids = (("choices", 0, "token_ids"), DROP)
    cases |= {
        # not an object / empty
        "completions/not_object": (co, [[C]], r"line 1: must be a JSON object \(got list\)$"),
        "vllm/not_object": (vl, ["17"], r"line 1: must be a JSON object \(got int\)$"),
        "trace/not_object": (tr, ['"ep7"'], r"line 1: must be a JSON object \(got str\)$"),
        "sglang/empty_list": (sg, ["[]"], r"line 1: holds an empty list \(no outputs\)$"),
        "sglang/item_not_object": (sg, [[S0, 5]], r'line 1, field "\[1\]": must be a JSON object \(got int\)$'),
        "auto/no_lines": ("auto", ["", "  "], r"holds no rollouts \(one JSON response per line\)$"),
        # a missing field
        "trace/missing_prompt": (
            tr,
            [edit(t0, (("prompt",), DROP))],
            r'line 1, field "prompt": missing \(give the prompt\'s token ids as prompt or prompt_token_ids\)$',
        ),
        "trace/missing_trace": (
            tr,
            [edit(t0, (("trace",), DROP), (("logprobs",), DROP))],
            r'line 1, field "trace": missing: a rollout needs its sampled tokens '
            r"\(trace, trace_token_ids, trace_decode_token_ids\)$",
        ),
        "trace/missing_id": (tr, [edit(t0, (("id",), DROP))], r'line 1, field "id": missing \(every request'),
        "completions/missing_choices": (co, [edit(C, (("choices",), DROP))], r'line 1, field "choices": missing$'),
        "completions/missing_id": (co, [edit(C, (("id",), DROP))], r'line 1, field "id": missing$'),
        "completions/missing_index": (
            co,
            [edit(C, (("choices", 0, "index"), DROP))],
            r'line 1, field "choices\[0\]\.index": missing$',
        ),
        "completions/missing_token_logprobs": (
            co,
            [edit(C, (("choices", 1, "logprobs", "token_logprobs"), DROP))],
            r'line 1, field "choices\[1\]\.logprobs\.token_logprobs": missing$',
        ),
        "completions/missing_prompt_ids": (
            co,
            [edit(C, (("choices", 0, "prompt_token_ids"), DROP))],
            r'line 1, field "choices\[0\]\.prompt_token_ids": missing: a completions response carries the '
            r'prompt\'s token ids only for a request with "return_token_ids": true; give the request bodies '
            r'instead \(requests_path=, one JSON line per response, "prompt" as token ids\)$',
        ),
        "chat/missing_prompt_ids": (
            ch,
            [edit(CH, (("prompt_token_ids",), DROP))],
            r'line 1, field "prompt_token_ids": missing: a chat response carries the prompt\'s token ids only '
            r'for a request with "return_token_ids": true$',
        ),
        "chat/missing_logprob": (
            ch,
            [edit(CH, (("choices", 0, "logprobs", "content", 1, "logprob"), DROP))],
            r'line 1, field "choices\[0\]\.logprobs\.content\[1\]\.logprob": missing$',
        ),
        "chat/missing_content": (
            ch,
            [edit(CH, (("choices", 1, "logprobs"), {}))],
            r'line 1, field "choices\[1\]\.logprobs\.content": missing$',
        ),
        "sglang/missing_input_logprobs": (
            sg,
            [edit(SGLANG, ((0, "meta_info", "input_token_logprobs"), DROP))],
            r'line 1, field "\[0\]\.meta_info\.input_token_logprobs": missing: request with logprob_start_len=0 '
            r"so that SGLang returns every prompt token$",
        ),
        "sglang/missing_prompt_tokens": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "prompt_tokens"), DROP))],
            r'line 1, field "\[1\]\.meta_info\.prompt_tokens": missing$',
        ),
        "sglang/missing_id": (sg, [edit(S0, (("meta_info", "id"), DROP))], r'line 1, field "meta_info\.id": missing$'),
        "sglang/missing_output": (
            sg,
            [edit(SGLANG, ((0, "meta_info", "output_token_logprobs"), DROP), ((0, "output_ids"), DROP))],
            r'line 1, field "\[0\]\.meta_info\.output_token_logprobs": missing \(request with return_logprob\)$',
        ),
        "vllm/missing_token_ids": (
            vl,
            [edit(V, (("outputs", 1, "token_ids"), DROP))],
            r'line 1, field "outputs\[1\]\.token_ids": missing$',
        ),
        "vllm/missing_prompt": (
            vl,
            [edit(V, (("prompt_token_ids",), DROP))],
            r'line 1, field "prompt_token_ids": missing$',
        ),
        "vllm/missing_request_id": (vl, [edit(V, (("request_id",), DROP))], r'line 1, field "request_id": missing$'),
        "vllm/sampled_token_absent": (
            vl,
            [edit(V, (("outputs", 0, "logprobs", 1), {"11": _lp(-3.0, 4, ",")}))],
            r'line 1, field "outputs\[0\]\.logprobs\[1\]": has no entry for the sampled token 13$',
        ),
        "vllm/missing_logprob": (
            vl,
            [edit(V, (("outputs", 0, "logprobs", 0, "6303"), {"rank": 1}))],
            r'line 1, field "outputs\[0\]\.logprobs\[0\]\["6303"\]\.logprob": missing$',
        ),
        # lengths that disagree
        "trace/logprobs_short": (
            tr,
            [edit(t0, (("logprobs",), [-0.25, -1.5]))],
            r'line 1, field "logprobs": holds 2 logprobs but trace holds 3 tokens$',
        ),
        "completions/token_logprobs_short": (
            co,
            [edit(C, (("choices", 1, "logprobs", "token_logprobs"), [-3.5]))],
            r'line 1, field "choices\[1\]\.logprobs\.token_logprobs": holds 1 logprobs but '
            r"choices\[1\]\.logprobs\.tokens holds 2 tokens$",
        ),
        "completions/tokens_vs_token_ids": (
            co,
            [edit(C, (("choices", 0, "token_ids"), [12095, 13]))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": holds 3 tokens but choices\[0\]\.token_ids holds 2$',
        ),
        "completions/placeholder_disagrees": (
            co,
            [edit(C, (("choices", 0, "logprobs", "tokens", 1), "token_id:14"))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": entry 1 is \'token_id:14\' but '
            r"choices\[0\]\.token_ids has 13 there$",
        ),
        "chat/content_short": (
            ch,
            [edit(CH, (("choices", 1, "logprobs", "content"), CH["choices"][1]["logprobs"]["content"][:1]))],
            r'line 1, field "choices\[1\]\.logprobs\.content": holds 1 tokens but choices\[1\]\.token_ids holds 2$',
        ),
        "sglang/output_ids_differ": (
            sg,
            [edit(SGLANG, ((0, "output_ids"), [6303]))],
            r'line 1, field "\[0\]\.output_ids": differs from the token ids of '
            r"\[0\]\.meta_info\.output_token_logprobs$",
        ),
        "sglang/prompt_incomplete": (
            sg,
            [edit(SGLANG, ((0, "meta_info", "input_token_logprobs"), SGLANG_PROMPT[-1:]))],
            r'line 1, field "\[0\]\.meta_info\.input_token_logprobs": holds 1 of the prompt\'s 4 tokens '
            r"\(meta_info\.prompt_tokens\): request with logprob_start_len=0 so that SGLang returns every "
            r"prompt token$",
        ),
        "sglang/short_entry": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "output_token_logprobs", 1), [-1.0]))],
            r'line 1, field "\[1\]\.meta_info\.output_token_logprobs": entry 1 must be \[logprob, token id, text\] '
            r"\(got \[-1\.0\]\)$",
        ),
        "vllm/logprobs_short": (
            vl,
            [edit(V, (("outputs", 0, "logprobs"), V["outputs"][0]["logprobs"][:1]))],
            r'line 1, field "outputs\[0\]\.logprobs": holds 1 positions but outputs\[0\]\.token_ids holds 2 tokens$',
        ),
        # token ids beyond the vocabulary, and too long for n_positions
        "trace/beyond_vocab": (
            tr,
            [edit(t0, (("trace", 1), 152064))],
            r'line 1, field "trace": token id 152064 at index 1 is not below the model\'s vocab_size 152064$',
        ),
        "completions/beyond_vocab": (
            co,
            [
                edit(
                    C,
                    (("choices", 0, "token_ids", 2), 152064),
                    (("choices", 0, "logprobs", "tokens", 2), "token_id:152064"),
                )
            ],
            r'line 1, field "choices\[0\]\.token_ids": token id 152064 at index 2 is not below the model\'s '
            r"vocab_size 152064$",
        ),
        "completions/placeholder_beyond_vocab": (
            co,
            [edit(C, no_ids, (("choices", 0, "logprobs", "tokens", 0), "token_id:152100"))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": token id 152100 at index 0 is not below the '
            r"model's vocab_size 152064$",
        ),
        "chat/prompt_beyond_vocab": (
            ch,
            [edit(CH, (("prompt_token_ids",), CHAT_PROMPT[:3] + [200000]))],
            r'line 1, field "prompt_token_ids": token id 200000 at index 3 is not below the model\'s vocab_size',
        ),
        "sglang/input_beyond_vocab": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "input_token_logprobs"), SGLANG_PROMPT[:2] + [[-1.0, 160000, None]] * 2))],
            r'line 1, field "\[1\]\.meta_info\.input_token_logprobs": token id 160000 at index 2 is not below',
        ),
        "vllm/beyond_vocab": (
            vl,
            [
                edit(
                    V,
                    (("outputs", 1, "token_ids", 1), 152064),
                    (("outputs", 1, "logprobs", 1), {"152064": _lp(-3.0, 4, None)}),
                )
            ],
            r'line 1, field "outputs\[1\]\.token_ids": token id 152064 at index 1 is not below the model\'s',
        ),
        "trace/too_long": (
            tr,
            [{"id": "long", "prompt": [1] * 40, "trace": [2] * 9}],
            r'line 1, field "trace": prompt \(40\) \+ decoded tokens \(9\) = 49 exceed the model\'s n_positions 48$',
        ),
        "vllm/too_long": (
            vl,
            [edit(V, (("prompt_token_ids",), [1] * 47))],
            r'line 1, field "outputs\[0\]\.token_ids": prompt \(47\) \+ decoded tokens \(2\) = 49 exceed',
        ),
        # negative ids
        "trace/negative": (
            tr,
            [edit(t0, (("prompt", 1), -872))],
            r'line 1, field "prompt": token id -872 at index 1 is negative$',
        ),
        "completions/negative_placeholder": (
            co,
            [edit(C, no_ids, (("choices", 0, "logprobs", "tokens", 0), "token_id:-5"))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": token id -5 in entry 0 is negative$',
        ),
        "chat/negative": (
            ch,
            [edit(CH, (("choices", 0, "token_ids", 0), -1))],
            r'line 1, field "choices\[0\]\.token_ids": token id -1 at index 0 is negative$',
        ),
        "sglang/negative": (
            sg,
            [edit(SGLANG, ((0, "meta_info", "output_token_logprobs", 1, 1), -3))],
            r'line 1, field "\[0\]\.meta_info\.output_token_logprobs": token id -3 in entry 1 is negative$',
        ),
        "vllm/negative": (
            vl,
            [edit(V, (("prompt_token_ids", 1), -1))],
            r'line 1, field "prompt_token_ids": token id -1 at index 1 is negative$',
        ),
        # ids that are not integers (a bool is not one)
        "trace/bool_id": (
            tr,
            [edit(t0, (("trace", 0), True))],
            r'line 1, field "trace": must hold integer token ids \(got True at index 0\)$',
        ),
        "completions/float_id": (
            co,
            [edit(C, (("choices", 0, "token_ids", 1), 13.0))],
            r'line 1, field "choices\[0\]\.token_ids": must hold integer token ids \(got 13\.0 at index 1\)$',
        ),
        "completions/bool_index": (
            co,
            [edit(C, (("choices", 0, "index"), True))],
            r'line 1, field "choices\[0\]\.index": must be an integer \(got True\)$',
        ),
        "chat/string_id": (
            ch,
            [edit(CH, (("prompt_token_ids", 0), "151644"))],
            r'line 1, field "prompt_token_ids": must hold integer token ids \(got \'151644\' at index 0\)$',
        ),
        "sglang/bool_id": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "output_token_logprobs", 0, 1), True))],
            r'line 1, field "\[1\]\.meta_info\.output_token_logprobs": must hold integer token ids '
            r"\(got True in entry 0\)$",
        ),
        "vllm/bool_id": (
            vl,
            [edit(V, (("outputs", 0, "token_ids", 0), True))],
            r'line 1, field "outputs\[0\]\.token_ids": must hold integer token ids \(got True at index 0\)$',
        ),
        # logprobs that are NaN, infinite, positive or not numbers
        "trace/nan": (
            tr,
            [raw(t0, (("logprobs", 1), "@X@"), X="NaN")],
            r'line 1, field "logprobs": entry 1 is NaN$',
        ),
        "trace/tiny_positive": (
            tr,
            [edit(t0, (("logprobs", 0), 1e-7))],
            r'line 1, field "logprobs": entry 0 is 1e-07, above 0 \(a logprob is at most 0\)$',
        ),
        "completions/inf": (
            co,
            [raw(C, (("choices", 0, "logprobs", "token_logprobs", 2), "@X@"), X="Infinity")],
            r'line 1, field "choices\[0\]\.logprobs\.token_logprobs": entry 2 is infinite \(inf\)$',
        ),
        "completions/minus_inf": (
            co,
            [raw(C, (("choices", 1, "logprobs", "token_logprobs", 0), "@X@"), X="-Infinity")],
            r'line 1, field "choices\[1\]\.logprobs\.token_logprobs": entry 0 is infinite \(-inf\)$',
        ),
        "completions/null_logprob": (
            co,
            [edit(C, (("choices", 0, "logprobs", "token_logprobs", 0), None))],
            r'line 1, field "choices\[0\]\.logprobs\.token_logprobs": entry 0 must be a number \(got None\)$',
        ),
        "completions/huge_int_logprob": (
            co,
            [raw(C, (("choices", 0, "logprobs", "token_logprobs", 1), "@X@"), X=HUGE_INT)],
            r'line 1, field "choices\[0\]\.logprobs\.token_logprobs": entry 1 is too large to be a logprob '
            r"\(-10+\.\.\.\)$",
        ),
        "chat/nan": (
            ch,
            [raw(CH, (("choices", 0, "logprobs", "content", 0, "logprob"), "@X@"), X="NaN")],
            r'line 1, field "choices\[0\]\.logprobs\.content\[0\]\.logprob": is NaN$',
        ),
        "chat/positive": (
            ch,
            [edit(CH, (("choices", 0, "logprobs", "content", 1, "logprob"), 0.5))],
            r'line 1, field "choices\[0\]\.logprobs\.content\[1\]\.logprob": is 0\.5, above 0 '
            r"\(a logprob is at most 0\)$",
        ),
        "chat/string_logprob": (
            ch,
            [edit(CH, (("choices", 1, "logprobs", "content", 0, "logprob"), "-8.25"))],
            r'line 1, field "choices\[1\]\.logprobs\.content\[0\]\.logprob": must be a number \(got \'-8\.25\'\)$',
        ),
        "sglang/nan": (
            sg,
            [raw(SGLANG, ((0, "meta_info", "output_token_logprobs", 0, 0), "@X@"), X="NaN")],
            r'line 1, field "\[0\]\.meta_info\.output_token_logprobs": the logprob of entry 0 is NaN$',
        ),
        "sglang/null_logprob": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "output_token_logprobs", 1, 0), None))],
            r'line 1, field "\[1\]\.meta_info\.output_token_logprobs": the logprob of entry 1 must be a number '
            r"\(got None\)$",
        ),
        "sglang/positive": (
            sg,
            [edit(S0, (("meta_info", "output_token_logprobs", 1, 0), 2.5))],
            r'line 1, field "meta_info\.output_token_logprobs": the logprob of entry 1 is 2\.5, above 0',
        ),
        "vllm/minus_inf": (
            vl,
            [raw(V, (("outputs", 1, "logprobs", 1, "11", "logprob"), "@X@"), X="-1e400")],
            r'line 1, field "outputs\[1\]\.logprobs\[1\]\["11"\]\.logprob": is infinite \(-inf\)$',
        ),
        "vllm/tiny_positive": (
            vl,
            [edit(V, (("outputs", 0, "logprobs", 1, "13", "logprob"), 3e-8))],
            r'line 1, field "outputs\[0\]\.logprobs\[1\]\["13"\]\.logprob": is 3e-08, above 0 '
            r"\(a logprob is at most 0\)$",
        ),
        # tokens given as text, without ids
        "completions/text_tokens": (
            co,
            [edit(C, no_ids, (("choices", 0, "logprobs", "tokens", 0), " Paris"))],
            rf'line 1, field "choices\[0\]\.logprobs\.tokens": entry 0 is text \(\' Paris\'\), not "token_id:N": '
            rf"{NEEDS_IDS}$",
        ),
        "completions/no_ids": (
            co,
            [edit(C, (("choices", 1, "token_ids"), DROP), (("choices", 1, "logprobs"), None))],
            rf'line 1, field "choices\[1\]\.token_ids": missing: the response has no token ids \({NEEDS_IDS}, '
            r"and logprobs\)$",
        ),
        "chat/text_tokens": (
            ch,
            [edit(CH, no_ids, (("choices", 0, "logprobs", "content", 0, "token"), "4"))],
            rf'line 1, field "choices\[0\]\.logprobs\.content\[0\]\.token": the token is text \(\'4\'\), not '
            rf'"token_id:N": {NEEDS_IDS}$',
        ),
        "chat/token_not_string": (
            ch,
            [edit(CH, no_ids, (("choices", 0, "logprobs", "content", 0, "token"), 19))],
            r'line 1, field "choices\[0\]\.logprobs\.content\[0\]\.token": the token must be a string \(got 19\)$',
        ),
        # empty completions
        "trace/empty": (
            tr,
            [edit(t0, (("trace",), []), (("logprobs",), []))],
            r'line 1, field "trace": must not be empty$',
        ),
        "completions/no_choices": (co, [edit(C, (("choices",), []))], r'line 1, field "choices": must not be empty$'),
        "completions/empty_token_ids": (
            co,
            [edit(C, (("choices", 0, "token_ids"), []))],
            r'line 1, field "choices\[0\]\.token_ids": must not be empty$',
        ),
        "completions/empty_tokens": (
            co,
            [edit(C, no_ids, (("choices", 0, "logprobs"), {"tokens": [], "token_logprobs": [], "top_logprobs": []}))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": must not be empty \(a rollout needs at least one '
            r"sampled token\)$",
        ),
        "chat/empty": (
            ch,
            [edit(CH, (("choices", 1, "token_ids"), DROP), (("choices", 1, "logprobs", "content"), []))],
            r'line 1, field "choices\[1\]\.logprobs\.content": must not be empty \(a rollout needs at least one '
            r"sampled token\)$",
        ),
        "sglang/empty": (
            sg,
            [edit(SGLANG, ((1, "output_ids"), DROP), ((1, "meta_info", "output_token_logprobs"), []))],
            r'line 1, field "\[1\]\.meta_info\.output_token_logprobs": must not be empty$',
        ),
        "vllm/empty": (
            vl,
            [edit(V, (("outputs", 0, "token_ids"), []), (("outputs", 0, "logprobs"), []))],
            r'line 1, field "outputs\[0\]\.token_ids": must not be empty$',
        ),
        "vllm/no_outputs": (vl, [edit(V, (("outputs",), []))], r'line 1, field "outputs": must not be empty$'),
        # huge numbers
        "trace/huge_id": (
            tr,
            [edit(t0, (("trace", 0), 2**40))],
            r'line 1, field "trace": token id 1099511627776 at index 0 is too large \(at most 2\*\*31 - 1\)$',
        ),
        "completions/huge_placeholder": (
            co,
            [edit(C, no_ids, (("choices", 0, "logprobs", "tokens", 0), "token_id:" + "9" * 30))],
            r'line 1, field "choices\[0\]\.logprobs\.tokens": entry 0 \'token_id:9+\.\.\. is too large '
            r"\(at most 2\*\*31 - 1\)$",
        ),
        "completions/huge_index": (
            co,
            [edit(C, (("choices", 0, "index"), 2**63))],
            r'line 1, field "choices\[0\]\.index": 9223372036854775808 is too large \(at most 2\*\*31 - 1\)$',
        ),
        "chat/integer_too_long": (
            ch,
            [raw(CH, (("choices", 0, "token_ids", 0), "@X@"), X="9" * 5000)],
            r"line 1: not valid JSON here \(Exceeds the limit \(4300 digits\) for integer string conversion",
        ),
        "sglang/huge_prompt_tokens": (
            sg,
            [edit(SGLANG, ((0, "meta_info", "prompt_tokens"), 10**20))],
            r'line 1, field "\[0\]\.meta_info\.prompt_tokens": 100000000000000000000 is too large',
        ),
        "vllm/float_request_id": (
            vl,
            [edit(V, (("request_id",), 1.5e300))],
            r'line 1, field "request_id": must be a string or an integer \(got 1\.5e\+300\)$',
        ),
        # duplicate ids
        "trace/duplicate": (
            tr,
            [t0, edit(t0, (("prompt",), [1]))],
            r"line 2, field \"id\": duplicate id 'ep7-turn2' \(first on line 1\)$",
        ),
        "completions/duplicate_index": (
            co,
            [edit(C, (("choices", 1, "index"), 0))],
            r"line 1, field \"choices\[1\]\.index\": duplicate id 'cmpl-8f3a/0' \(first on line 1\)$",
        ),
        "chat/duplicate_response": (
            ch,
            [CH, CHAT_NO_LOGPROBS, CH],
            r"line 3, field \"choices\[0\]\.index\": duplicate id 'chatcmpl-b21e/0' \(first on line 1\)$",
        ),
        "sglang/duplicate": (
            sg,
            [edit(SGLANG, ((1, "meta_info", "id"), "7d1e_0"))],
            r"line 1, field \"\[1\]\.meta_info\.id\": duplicate id '7d1e_0' \(first on line 1\)$",
        ),
        "vllm/duplicate": (
            vl,
            [V, V],
            r"line 2, field \"outputs\[0\]\.index\": duplicate id '17/0' \(first on line 1\)$",
        ),
        # logprobs_mode
        "trace/logits_mode": (
            tr,
            [edit(t0, (("logprobs_mode",), "raw_logits"))],
            rf"line 1, field \"logprobs_mode\": 'raw_logits': {LOGITS}$",
        ),
        "completions/unknown_mode": (
            co,
            [edit(C, (("logprobs_mode",), "final"))],
            r"line 1, field \"logprobs_mode\": must be one of raw_logprobs, processed_logprobs \(got 'final'\)$",
        ),
        # a line that does not fit the format given (or found on the first line)
        "chat_as_completions": (
            co,
            [CH],
            r"line 1, field \"object\": is 'chat\.completion', not 'text_completion'$",
        ),
        "sglang_as_chat": (ch, [S0], r'line 1, field "id": missing$'),
        "completions_as_vllm": (vl, [C], r'line 1, field "request_id": missing$'),
        "vllm_as_trace": (tr, [V], r'line 1, field "trace": missing: a rollout needs its sampled tokens'),
        "auto/second_line_differs": (
            "auto",
            [C, CH],
            r"line 2, field \"object\": is 'chat\.completion', not 'text_completion'$",
        ),
        "auto/unknown": (
            "auto",
            ['{"prompt": [1], "foo": 2}'],
            r"line 1: cannot tell the rollout format from this line \(foo, prompt\); give one of trace, "
            r"openai-completions, openai-chat, sglang, vllm-offline$",
        ),
        "auto/stream_chunk": (
            "auto",
            [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "4"}}]}],
            r"line 1: cannot tell the rollout format from this line \(choices, id, object\)",
        ),
        "auto/list": ("auto", ["[1, 2]"], r"line 1: cannot tell the rollout format from this line \(list\)"),
        "auto/control_char_key": (  # the message stays one line: the key is shown escaped
            "auto",
            ['{"\\r": null, "' + "k" * 50 + '": 1}'],
            r"line 1: cannot tell the rollout format from this line \('\\r', k{39}…\); give one",
        ),
    }
    return cases


BAD = _cases()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_lines_name_file_line_and_field(tmp_path, case):
    fmt, lines, pattern = BAD[case]
    path = write(tmp_path, *lines)
    prefix = "^" + re.escape(path) + (", " if pattern.startswith("line") else ": ")
    with pytest.raises(TraceFileError, match=prefix + pattern):
        read_rollouts(path, CONFIG, format=fmt)


def test_the_error_carries_path_line_and_field(tmp_path):
    path = write(tmp_path, CHAT_NO_LOGPROBS, edit(CHAT, (("choices", 1, "token_ids", 0), -4)))
    with pytest.raises(TraceFileError) as exc:
        read_rollouts(path)
    assert (exc.value.path, exc.value.line, exc.value.field) == (path, 2, "choices[1].token_ids")


def test_without_config_ids_below_the_bound_pass(tmp_path):
    line = edit(TRACE[0], (("trace",), [2**31 - 1, 152064, 0]))
    assert read_rollouts(write(tmp_path, line))[0].request.trace == (2**31 - 1, 152064, 0)
    with pytest.raises(TraceFileError, match=r"token id 2147483648 at index 0 is too large"):
        read_rollouts(write(tmp_path, edit(line, (("trace", 0), 2**31))))


# Properties ---------------------------------------------------------------------------------------
KEYS = [
    "id", "prompt", "prompt_token_ids", "trace", "logprobs", "logprobs_mode", "object", "choices", "index",
    "token_ids", "tokens", "token_logprobs", "content", "token", "logprob", "meta_info", "output_ids",
    "output_token_logprobs", "input_token_logprobs", "prompt_tokens", "request_id", "outputs", "n", "echo",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["token_id:5", "token_id:-1", "token_id:", " the", "text_completion", "chat.completion"])
    | st.text(max_size=6)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=24,
)
FORMATS = ("auto", *ROLLOUT_FORMATS)
PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _check_rollouts(rollouts):
    """What every successful read promises, whatever the input."""
    ids = [r.request.id for r in rollouts]
    assert rollouts and len(set(ids)) == len(ids)
    for r in rollouts:
        tokens = r.request.prompt + r.request.trace
        assert (
            r.request.prompt and r.request.trace and all(type(t) is int and 0 <= t < CONFIG.vocab_size for t in tokens)
        )
        assert len(tokens) <= CONFIG.n_positions
        if r.logprobs is not None:
            assert r.logprobs.shape == (len(r.request.trace),) and r.logprobs.dtype == np.float64
            assert np.all(np.isfinite(r.logprobs)) and np.all(r.logprobs <= 0)


def _read(path, fmt, **kwargs):
    try:
        _check_rollouts(read_rollouts(path, CONFIG, format=fmt, **kwargs))
    except TraceFileError:
        pass


@PROPERTY
@given(value=json_values, fmt=st.sampled_from(FORMATS))
def test_random_json_raises_only_trace_file_errors(tmp_path, value, fmt):
    _read(write(tmp_path, json.dumps(value)), fmt)


def _paths(value, prefix=()):
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@PROPERTY
@given(data=st.data(), fmt=st.sampled_from(ROLLOUT_FORMATS))
def test_edited_examples_raise_only_trace_file_errors(tmp_path, data, fmt):
    """One value anywhere in a valid line replaced by random JSON (or deleted): the read either
    succeeds with sound rollouts or raises TraceFileError."""
    example = EXAMPLES[fmt][0]
    path = data.draw(st.sampled_from(list(_paths(example))[1:]))
    value = data.draw(st.just(DROP) | json_values)
    line = edit(example, (path, value))
    _read(write(tmp_path, json.dumps(line)), data.draw(st.sampled_from((fmt, "auto"))))


@PROPERTY
@given(body=json_values | st.fixed_dictionaries({"prompt": json_values, "n": json_values}))
def test_random_request_bodies_raise_only_trace_file_errors(tmp_path, body):
    responses = write(tmp_path, RESPONSES[0], name="responses.jsonl")
    _read(responses, "openai-completions", requests_path=write(tmp_path, json.dumps(body), name="requests.jsonl"))
