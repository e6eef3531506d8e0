"""Trace files: parsing, validation against the model, writing (numpy-free, no framework)."""

import json
import os
import re

import pytest

from trace_replay_app.models.gpt2 import GPT2Config
from trace_replay_app.records import TraceRequest
from trace_replay_app.traces import (
    TraceFileError,
    atomic_write,
    random_requests,
    read_traces,
    request_to_json,
    write_traces,
)

CONFIG = GPT2Config()  # vocab 512, n_positions 128


def _file(tmp_path, *lines, name="traces.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_reads_every_accepted_spelling(tmp_path):
    path = _file(
        tmp_path,
        '{"id": "a", "prompt": [1, 2, 3], "trace": [4, 5]}',
        "",
        '{"id": 7, "prompt_token_ids": [9], "trace_token_ids": [1, 2, 3], "text": "ignored"}',
        '{"id": "c", "prompt": [0], "trace_decode_token_ids": [511], "max_new_tokens": 1}',
        '{"id": "d", "prompt": [5, 6], "trace": null, "max_new_tokens": 4}',
        "   ",
    )
    reqs = read_traces(path, CONFIG)
    assert reqs == [
        TraceRequest("a", (1, 2, 3), (4, 5), 2),
        TraceRequest("7", (9,), (1, 2, 3), 3),
        TraceRequest("c", (0,), (511,), 1),
        TraceRequest("d", (5, 6), None, 4),
    ]
    assert [r.new_tokens for r in reqs] == [2, 3, 1, 4]


def test_write_then_read_round_trip(tmp_path):
    reqs = random_requests(CONFIG, 40, seed=3, traced=0.5)
    assert sum(r.trace is not None for r in reqs) == 20
    path = str(tmp_path / "t.jsonl")
    write_traces(path, reqs)
    assert read_traces(path, CONFIG) == reqs
    with open(path) as f:
        first = json.loads(f.readline())
    assert first == request_to_json(reqs[0])
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_random_requests_fit_the_model():
    small = GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    reqs = random_requests(small, 100, seed=1, prompt_len=(1, 40), new_tokens=(1, 40))
    assert all(len(r.prompt) + r.new_tokens <= 16 and r.new_tokens >= 1 for r in reqs)
    assert all(0 <= t < 50 for r in reqs for t in r.prompt + (r.trace or ()))
    assert random_requests(small, 5, seed=2) == random_requests(small, 5, seed=2)


# id -> (lines, anchored regex of the message after the file name)
BAD = {
    "not_json": (
        ['{"id": "a", "prompt": [1], "trace": [2]}', '{"id": "b", "prompt": [1'],
        r"line 2: not valid JSON \(.*\)$",
    ),
    "not_object": (["[1, 2]"], r"line 1: must be a JSON object \(got list\)$"),
    "missing_id": (['{"prompt": [1], "trace": [2]}'], r'line 1, field "id": missing'),
    "bad_id": (['{"id": true, "prompt": [1], "trace": [2]}'], r'line 1, field "id": must be a string or an integer'),
    "empty_id": (['{"id": "", "prompt": [1], "trace": [2]}'], r'line 1, field "id": must not be empty$'),
    "duplicate_id": (
        [
            '{"id": "a", "prompt": [1], "trace": [2]}',
            '{"id": 5, "prompt": [1], "trace": [2]}',
            '{"id": "a", "prompt": [3], "trace": [4]}',
        ],
        r"line 3, field \"id\": duplicate id 'a' \(first on line 1\)$",
    ),
    "missing_prompt": (['{"id": "a", "trace": [2]}'], r'line 1, field "prompt": missing'),
    "empty_prompt": (['{"id": "a", "prompt": [], "trace": [2]}'], r'line 1, field "prompt": must not be empty$'),
    "prompt_not_list": (
        ['{"id": "a", "prompt": "hello", "trace": [2]}'],
        r'line 1, field "prompt": must be a list of token ids \(got str\)$',
    ),
    "float_token": (
        ['{"id": "a", "prompt": [1, 2.0], "trace": [2]}'],
        r'line 1, field "prompt": must hold integer token ids \(got 2\.0 at index 1\)$',
    ),
    "negative_prompt": (
        ['{"id": "a", "prompt_token_ids": [1, -3], "trace": [2]}'],
        r'line 1, field "prompt_token_ids": token id -3 at index 1 is negative$',
    ),
    "negative_trace": (
        ['{"id": "a", "prompt": [1], "trace": [2, 3, -1]}'],
        r'line 1, field "trace": token id -1 at index 2 is negative$',
    ),
    "prompt_too_large": (
        ['{"id": "a", "prompt": [512], "trace": [2]}'],
        r'line 1, field "prompt": token id 512 at index 0 is not below the model\'s vocab_size 512$',
    ),
    "trace_too_large": (
        ['{"id": "a", "prompt": [1], "trace_decode_token_ids": [1, 9000]}'],
        (
            r'line 1, field "trace_decode_token_ids": token id 9000 at index 1 is not below the '
            r"model's vocab_size 512$"
        ),
    ),
    "empty_trace": (['{"id": "a", "prompt": [1], "trace": []}'], r'line 1, field "trace": must not be empty$'),
    "two_prompts": (
        ['{"id": "a", "prompt": [1], "prompt_token_ids": [1], "trace": [2]}'],
        r'line 1, field "prompt_token_ids": give only one of prompt, prompt_token_ids',
    ),
    "two_traces": (
        ['{"id": "a", "prompt": [1], "trace": [2], "trace_token_ids": [2]}'],
        r'line 1, field "trace_token_ids": give only one of trace, trace_token_ids',
    ),
    "untraced_without_count": (
        ['{"id": "a", "prompt": [1]}'],
        r'line 1, field "max_new_tokens": missing: a request without a trace',
    ),
    "bad_count": (
        ['{"id": "a", "prompt": [1], "max_new_tokens": 0}'],
        r'line 1, field "max_new_tokens": must be a positive integer \(got 0\)$',
    ),
    "count_differs_from_trace": (
        ['{"id": "a", "prompt": [1], "trace": [2, 3], "max_new_tokens": 5}'],
        r'line 1, field "max_new_tokens": must equal the trace\'s length 2',
    ),
    "trace_too_long": (
        ['{"id": "a", "prompt": [1], "trace": [2]}', json.dumps({"id": "b", "prompt": [1] * 100, "trace": [2] * 29})],
        (
            r'line 2, field "trace": prompt \(100\) \+ decoded tokens \(29\) = 129 exceed the '
            r"model's n_positions 128$"
        ),
    ),
    "untraced_too_long": (
        [json.dumps({"id": "b", "prompt": [1] * 100, "max_new_tokens": 40})],
        r'line 1, field "max_new_tokens": prompt \(100\) \+ decoded tokens \(40\) = 140 exceed',
    ),
    "no_requests": (["", "  "], r"holds no requests"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_name_line_and_field(tmp_path, case):
    lines, pattern = BAD[case]
    path = _file(tmp_path, *lines)
    prefix = "^" + re.escape(path) + (", " if pattern.startswith("line") else ": ")
    with pytest.raises(TraceFileError, match=prefix + pattern):
        read_traces(path, CONFIG)


def test_error_attributes(tmp_path):
    path = _file(tmp_path, '{"id": "a", "prompt": [1], "trace": [2]}', '{"id": "b", "prompt": []}')
    with pytest.raises(TraceFileError) as exc:
        read_traces(path, CONFIG)
    assert (exc.value.path, exc.value.line, exc.value.field) == (path, 2, "prompt")


# id -> (file bytes, anchored regex after the file name): files no JSON Lines reader should trust.
GOOD_LINE = b'{"id": "a", "prompt": [1, 2], "trace": [3]}\n'
BAD_BYTES = {
    "not_utf8": (
        GOOD_LINE + b'{"id": "b", "prompt": [1], "trace": [2]}\xff\n',
        r"line 2: not UTF-8 \(byte 0xff "
        r"at column 41\)$",
    ),
    "latin1": (b'{"id": "caf\xe9", "prompt": [1], "trace": [2]}\n', r"line 1: not UTF-8 \(byte 0xe9 at column 12\)$"),
    "nested_deeply": (
        b'{"id": "a", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        r"line 1: not valid JSON here \(nested too deeply to read\)$",
    ),
    "integer_too_long": (
        b'{"id": "a", "prompt": [' + b"9" * 5000 + b'], "trace": [1]}\n',
        r"line 1: not valid JSON here \(Exceeds the limit \(4300 digits\) for integer string "
        r"conversion: value has 5000 digits\)$",
    ),
    "bom_not_first": (
        GOOD_LINE + b"\xef\xbb\xbf" + GOOD_LINE.replace(b'"a"', b'"b"'),
        r"line 2: not valid JSON \(.*\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BYTES))
def test_bad_bytes_name_the_line_and_raise_no_other_error(tmp_path, case):
    data, pattern = BAD_BYTES[case]
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    with pytest.raises(TraceFileError, match="^" + re.escape(str(path)) + ", " + pattern):
        read_traces(str(path), CONFIG)


def test_a_leading_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE + GOOD_LINE.replace(b'"a"', b'"b"'))
    assert [r.id for r in read_traces(str(path), CONFIG)] == ["a", "b"]


def test_without_config_only_the_syntax_is_checked(tmp_path):
    path = _file(tmp_path, '{"id": "a", "prompt": [100000], "trace": [200000]}')
    assert read_traces(path)[0].trace == (200000,)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(RuntimeError, match="^boom$"), atomic_write(str(target)) as f:
        f.write("partial")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    target.write_text("old")
    with pytest.raises(RuntimeError, match="^boom$"), atomic_write(str(target)) as f:
        f.write("new")
        raise RuntimeError("boom")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    with atomic_write(str(target)) as f:
        f.write("new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
