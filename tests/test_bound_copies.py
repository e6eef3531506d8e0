"""CPU tier: a bound call refuses an array whose producer exported a copy over DLPack (the
IS_COPIED flag), naming it, since it keeps the pointer past the capsule; unbound calls read it."""

import numpy as np
import pytest
from helpers.backward_cases import make_backward_case
from helpers.dlpack_producers import CopyingProducer as Copy

from trace_replay_core import (
    TraceTable,
    bind_logprob_rank,
    bind_logprob_rank_backward,
    token_logprob_rank,
    token_logprob_rank_backward,
)

REFUSAL = r"^{}'s producer exported a copy over DLPack \(the IS_COPIED flag\): a bound call keeps its pointer"


def _table():
    table = TraceTable(4, 8, device="cpu")
    table.stage(1, [5, 6, 7])
    table.commit(stream=0)
    return table


def _replay_arrays():
    return dict(
        sampled=np.full(3, 9, np.int64), idx=np.array([1, 0, -1], np.int32), step=np.array([1, 0, 0], np.int32),
        total=np.array([0, 3, 0, 0], np.int32), prompt=np.array([0, 2, 0, 0], np.int32),
    )  # fmt: skip


def _args(a, copied):
    """A replay's arrays from ``a`` as keyword arguments (per-slot lengths, or a per-row step when
    ``copied`` is the step), the one named ``copied`` given as a copy."""
    if copied == "step":
        args = dict(idx_mapping=a["idx"], step=a["step"])
    else:
        args = dict(idx_mapping=a["idx"], total_len=a["total"], prompt_len=a["prompt"])
    args[copied] = Copy(args[copied])
    return args


def _lengths(a, copied):
    args = _args(a, copied)
    del args["idx_mapping"]
    return args


# "method-argument" -> the call on a table and fresh arrays, that argument given as a copy
REPLAY_CASES = {
    **{f"bind_replay-{n}": lambda t, a, n=n: t.bind_replay(a["sampled"], **_args(a, n), stream=0)
       for n in ("idx_mapping", "total_len", "prompt_len", "step")},
    **{f"replay_cached-{n}": lambda t, a, n=n: t.replay_cached("k", a["sampled"], **_args(a, n), stream=0)
       for n in ("idx_mapping", "total_len", "prompt_len", "step")},
    **{f"bind_lengths-{n}": lambda t, a, n=n: t.bind_lengths(**_lengths(a, n), stream=0)
       for n in ("total_len", "prompt_len")},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REPLAY_CASES))
def test_bound_replays_refuse_copies(case):
    """Nothing is bound, cached or written by a refused call."""
    call, name = REPLAY_CASES[case], case.split("-")[1]
    arrays = _replay_arrays()
    with _table() as table:
        with pytest.raises(ValueError, match=REFUSAL.format(name)):
            call(table, arrays)
        assert not table.lengths_bound and len(table._replays) == 0
        assert arrays["sampled"].tolist() == [9, 9, 9]


def test_replay_cached_refuses_a_copy_only_when_it_binds():
    """A hit validates nothing (the hot path): the refusal is the miss's, and the bound lengths'."""
    a = _replay_arrays()
    with _table() as table:
        table.bind_lengths(a["total"], a["prompt"], stream=0)
        table.replay_cached("k", a["sampled"], a["idx"], stream=0)
        assert a["sampled"].tolist() == [6, 9, 9]
        with pytest.raises(ValueError, match=REFUSAL.format("idx_mapping")):
            table.replay_cached("other", a["sampled"], Copy(a["idx"]), stream=0)


def _logprob_arrays(rng):
    logits = rng.standard_normal((3, 20)).astype(np.float32)
    return dict(
        logits=logits, ids=np.array([1, 4, 19]), temp=np.array([0.5, 1.0, 2.0], np.float32),
        lp=np.full(3, 7.0, np.float32), rk=np.full(3, 7, np.int64),
    )  # fmt: skip


@pytest.mark.parametrize("name", ["logits", "token_ids", "temperature"])
def test_bound_logprob_refuses_copies_and_the_call_reads_them(rng, name):
    a = _logprob_arrays(rng)
    args = {"logits": a["logits"], "token_ids": a["ids"], "temperature": a["temp"]}
    copied = dict(args, **{name: Copy(args[name])})
    outputs = dict(out_logprobs=a["lp"], out_ranks=a["rk"], stream=0)
    with pytest.raises(ValueError, match=REFUSAL.format(name)):
        bind_logprob_rank(**copied, **outputs)
    assert np.all(a["lp"] == 7.0) and np.all(a["rk"] == 7)
    token_logprob_rank(**copied, **outputs)  # the unbound call holds the copy while it reads it
    want_lp, want_rk = np.empty(3, np.float32), np.empty(3, np.int64)
    token_logprob_rank(**args, out_logprobs=want_lp, out_ranks=want_rk, stream=0)
    assert np.array_equal(a["lp"], want_lp) and np.array_equal(a["rk"], want_rk)


BACKWARD_INPUTS = [
    "logits", "token_ids", "logprobs", "grad_logprobs", "temperature", "argmax", "topk_ids", "topk_logprobs",
    "grad_topk_logprobs", "entropy", "grad_entropy",
]  # fmt: skip


@pytest.mark.parametrize("name", BACKWARD_INPUTS)
def test_bound_backward_refuses_copies_and_the_call_reads_them(rng, name):
    c = make_backward_case(rng, 3, 12, "float32", temp=True, top_k=2, entropy=True, argmax=True)
    args = dict(
        logits=c["x"], token_ids=c["ids"], logprobs=c["lp"], grad_logprobs=c["g"], temperature=c["temp"],
        argmax=c["am"], topk_ids=c["tid"], topk_logprobs=c["tlp"], grad_topk_logprobs=c["gk"],
        entropy=c["ent"], grad_entropy=c["ge"],
    )  # fmt: skip
    copied = dict(args, **{name: Copy(args[name])})
    grad = np.full_like(c["x"], 7.0)
    with pytest.raises(ValueError, match=REFUSAL.format(name)):
        bind_logprob_rank_backward(**copied, out_grad_logits=grad, stream=0)
    assert np.all(grad == 7.0)
    token_logprob_rank_backward(**copied, out_grad_logits=grad, stream=0)
    want = np.empty_like(grad)
    token_logprob_rank_backward(**args, out_grad_logits=want, stream=0)
    assert np.array_equal(grad, want)
