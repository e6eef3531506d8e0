"""``trace_replay_app.trace_sets``: the seeded request sets the pytest plugin's ``trace_set``
fixture gives (numpy only): deterministic in the seed, within the model's limits, each kind
holding what its name promises; a trace file checked against the limits."""

from __future__ import annotations

import pytest

from trace_replay_app.trace_sets import KINDS, TraceSet
from trace_replay_app.traces import TraceFileError


@pytest.mark.parametrize("limits", [(2, 4), (50, 40), (151_936, 128)])
@pytest.mark.parametrize("kind", KINDS)
def test_sets_are_seeded_and_fit_the_limits(kind, limits):
    vocab, positions = limits
    one = TraceSet(kind, seed=3).requests(vocab, positions)
    assert one == TraceSet(kind, seed=3).requests(vocab, positions)
    assert one != TraceSet(kind, seed=4).requests(vocab, positions) or vocab == 2
    assert len({r.id for r in one}) == len(one)
    for r in one:
        assert r.prompt and r.new_tokens >= 1 and len(r.prompt) + r.new_tokens <= positions
        assert all(0 <= t < vocab for t in r.prompt + (r.trace or ()))


def test_each_kind_holds_what_it_promises():
    random = TraceSet("random", n=12).requests(96, 64)
    assert len(random) == 12 and len(random[0].prompt) == 1 and random[0].trace is not None
    assert {r.trace is None for r in random} == {True, False}
    ties = {r.id: r for r in TraceSet("ties").requests(96, 64)}
    same = [ties[f"same-{kind}-{copy}"] for kind in ("free", "traced") for copy in "ab"]
    assert len({r.prompt for r in same}) == 1 and same[0].new_tokens == same[1].new_tokens
    assert same[2].trace == same[3].trace and same[0].trace is None
    assert len(set(ties["repeated-prompt"].prompt)) == 1 and len(set(ties["repeated-trace"].trace)) == 1
    long = TraceSet("long").requests(96, 64)
    assert [len(r.prompt) + r.new_tokens for r in long] == [64, 64, 64]
    assert len(long[0].prompt) == 1 and long[2].trace is None


def test_a_file_set_and_refusals(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"id": 1, "prompt": [3, 4], "trace": [5, 6, 7]}\n')
    (request,) = TraceSet("file", path=str(path)).requests(8, 5)
    assert request.prompt == (3, 4) and request.trace == (5, 6, 7)
    with pytest.raises(TraceFileError, match=r"line 1, field \"trace\": .*exceed the model's n_positions 4"):
        TraceSet("file", path=str(path)).requests(8, 4)
    with pytest.raises(ValueError, match=r"^kind must be one of random, ties, long or 'file' \(got 'rand'\)$"):
        TraceSet("rand")
    with pytest.raises(ValueError, match=r"^path is given with kind 'file' only"):
        TraceSet("file")
    with pytest.raises(ValueError, match=r"^a trace set needs vocab_size >= 2 and n_positions >= 4 \(got 1, 40\)$"):
        TraceSet("random").requests(1, 40)
