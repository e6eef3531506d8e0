"""The torch state reads the length tensors it was given by reference; JAX tables are passed in.

The behaviour (unchanged, and pinned here): an in-place update of ``total_len`` is seen by the
next replay, a name rebound to a new tensor is not (the state keeps replaying the steps of the
tensor it was given) until ``bind_lengths`` hands it the new one. What changed: the README's
quick starts say so, one sentence each, where a user reads them.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from trace_replay_torch import TraceReplayState

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
POISON = 2**30 + 7


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _prose(section: str) -> str:
    """The section without its code blocks, on one line."""
    return " ".join(re.sub(r"```.*?```", "", section, flags=re.S).split())


def test_in_place_updates_are_seen_and_a_rebound_name_is_not(rng):
    trace = rng.integers(0, 1000, 6)
    prompt_len = torch.tensor([3, 0], dtype=torch.int32)
    total_len = prompt_len.clone()
    idx = torch.tensor([0], dtype=torch.int32)
    with TraceReplayState(2, 8, device="cpu", total_len=total_len, prompt_len=prompt_len) as state:
        state.add_request(0, trace)
        state.apply_staged_writes()

        def step():
            return int(state.replay(torch.full((1,), POISON, dtype=torch.int64), idx)[0])

        assert step() == trace[0]
        total_len[0] += 1  # in place: seen
        assert step() == trace[1]
        total_len.copy_(total_len + 1)  # in place: seen
        assert step() == trace[2]
        total_len = total_len + 1  # a new tensor: the state still reads the old one
        assert step() == trace[2]
        state.bind_lengths(total_len, prompt_len)
        assert step() == trace[3]


def test_torch_quick_start_says_lengths_are_read_by_reference():
    prose = _prose(_section("PyTorch quick start"))
    assert re.search(
        r"The state reads the length tensors it was given by reference: update them in place "
        r"\(`total_len\[idx\] \+= 1`, `total_len\.copy_\(new\)`\), since a name rebound to a new tensor "
        r"\(`total_len = total_len \+ 1`\) leaves the state replaying the steps of the old one",
        prose,
    ), "the torch quick start must say that lengths are read by reference"


def test_jax_quick_start_says_tables_are_passed_in_never_closed_over():
    prose = _prose(_section("JAX quick start"))
    assert re.search(
        r"The tables are passed into a jitted function as an argument, never closed over: .* `replay` "
        r"refuses concrete tables under any trace",
        prose,
    ), "the JAX quick start must say that tables are passed in, never closed over"


@pytest.mark.parametrize("title", ["PyTorch quick start", "JAX quick start"])
def test_quick_starts_name_the_staged_writes_check(title):
    assert "StagedWritesWarning" in _prose(_section(title)) and "strict=True" in _prose(_section(title))
