"""CPU tier: the registered torch ops (``torch.ops.trace_replay.*``): opcheck, equality with the
eager methods, and a sampler compiled with ``torch.compile(fullgraph=True)``.

Compiles are slow on a small CI machine: one sampler compile with inductor, the rest with the
``eager`` backend (Dynamo's trace alone, which is what decides about graph breaks)."""

import numpy as np
import pytest
import torch
from helpers import assert_tokens_equal, random_scenario  # noqa: E402
from helpers.torch_samplers import DecodeLoop, eager_sampler, natural_sampler, op_sampler  # noqa: E402

from trace_replay_core import replay_reference  # noqa: E402
from trace_replay_torch import TraceReplayState, replay_at_step_op, replay_op, token_logprob_rank, token_logprob_rank_op  # noqa: E402

OPS = torch.ops.trace_replay


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _scenario_state(rng, *, batch, index_dtype=torch.int32, sampled_dtype=torch.int64):
    max_slots, max_len = 19, 13
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    st = TraceReplayState(
        max_slots,
        max_len,
        device="cpu",
        total_len=torch.from_numpy(sc["total_len"]).to(index_dtype),
        prompt_len=torch.from_numpy(sc["prompt_len"]).to(index_dtype),
    )
    for slot, tr in sc["traces"].items():
        st.add_request(slot, tr)
    st.apply_staged_writes()
    tensors = dict(
        sampled=torch.from_numpy(sc["sampled"]).to(sampled_dtype),
        idx=torch.from_numpy(sc["idx"]).to(index_dtype),
        step=torch.from_numpy(sc["step"]).to(index_dtype),
    )
    return sc, st, tensors


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_opcheck_replay_ops(rng, dtypes):
    sampled_dtype, index_dtype = dtypes
    for _ in range(50):  # a scenario in which the op really writes rows (opcheck compares what it wrote)
        sc, st, t = _scenario_state(rng, batch=37, index_dtype=index_dtype, sampled_dtype=sampled_dtype)
        expected = replay_reference(
            sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
        )
        if (expected != sc["sampled"]).any():
            break
        st.close()
    assert (expected != sc["sampled"]).any(), "no scenario with a replayed row in 50 draws"
    with st:
        total, prompt = st._bound_lengths()
        torch.library.opcheck(OPS.replay.default, (t["sampled"].clone(), t["idx"], total, prompt, st.op_id))
        torch.library.opcheck(OPS.replay_at_step.default, (t["sampled"].clone(), t["idx"], t["step"], st.op_id))
        torch.library.opcheck(OPS.replay.default, (t["sampled"][:, None].clone(), t["idx"], total, prompt, st.op_id))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_logprob_rank(rng, dtype):
    logits = torch.from_numpy(rng.standard_normal((7, 131)).astype(np.float32)).to(dtype)
    tokens = torch.from_numpy(rng.integers(0, 131, 7))
    torch.library.opcheck(OPS.token_logprob_rank.default, (logits, tokens))
    grad = logits.requires_grad_(dtype == torch.float32)  # no gradient flows, and none is asked for
    torch.library.opcheck(OPS.token_logprob_rank.default, (grad, tokens[:, None]))


@pytest.mark.parametrize("top_k", [0, 5])
def test_opcheck_logprob_rank_options(rng, top_k):
    logits = torch.from_numpy(rng.standard_normal((6, 67)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, 67, 6))
    temperature = torch.from_numpy(rng.uniform(0.3, 2.0, 6).astype(np.float32))
    if top_k:
        torch.library.opcheck(OPS.token_logprob_rank_topk.default, (logits, tokens, top_k, temperature))
        torch.library.opcheck(OPS.token_logprob_rank_topk.default, (logits, tokens, top_k))
    else:
        torch.library.opcheck(OPS.token_logprob_rank.default, (logits, tokens, temperature))


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("temperature", [None, 0.7, "tensor"])
def test_logprob_op_matches_eager_with_options(rng, top_k, temperature):
    """Eagerly and compiled (Dynamo's trace), the op form returns the eager function's results."""
    logits = torch.from_numpy(rng.standard_normal((9, 41)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, 41, 9))
    if temperature == "tensor":
        temperature = torch.from_numpy(rng.uniform(0.3, 2.0, 9).astype(np.float32))
    want = token_logprob_rank(logits, tokens, top_k=top_k, temperature=temperature)

    def score(logits, tokens):
        return token_logprob_rank_op(logits, tokens, top_k=top_k, temperature=temperature)

    for got in (score(logits, tokens), torch.compile(score, fullgraph=True, backend="eager")(logits, tokens)):
        assert type(got) is type(want) and len(got) == (4 if top_k else 2)
        for name, g, w in zip(type(want)._fields, got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name


def test_ops_match_the_eager_methods(rng):
    """Each op wrapper, called eagerly, writes what the direct method and the reference write."""
    sc, st, t = _scenario_state(rng, batch=101)
    with st:
        expected = replay_reference(
            sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]
        )
        out = t["sampled"].clone()
        assert replay_op(st, out, t["idx"]) is out
        assert_tokens_equal(out.numpy(), expected, "replay_op, bound lengths")
        out = t["sampled"].clone()
        replay_op(st, out, t["idx"], *st._bound_lengths())
        assert_tokens_equal(out.numpy(), expected, "replay_op, explicit lengths")
        out = t["sampled"].clone()
        assert replay_at_step_op(st, out, t["idx"], t["step"]) is out
        assert_tokens_equal(
            out.numpy(),
            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"]),
            "replay_at_step_op",
        )
        logits = torch.from_numpy(rng.standard_normal((101, 263)).astype(np.float32))
        tokens = torch.from_numpy(rng.integers(-2, 265, 101))  # a few outside the vocabulary
        lp_op, rk_op = token_logprob_rank_op(logits, tokens)
        lp, rk = token_logprob_rank(logits, tokens)
        assert not lp.isnan().all() and torch.equal(lp_op.isnan(), (tokens < 0) | (tokens >= 263))
        torch.testing.assert_close(lp_op, lp, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(rk_op, rk)
        assert lp_op.dtype == torch.float32 and rk_op.dtype == torch.int64


def test_compiled_sampler_matches_eager_over_steps(rng):
    """``torch.compile(fullgraph=True)`` (inductor) of sample + replay + logprob: no graph break,
    and every step equal to the eager sampler, with requests admitted and committed between."""
    slots, batch, vocab = 16, 12, 97
    total = torch.zeros(slots, dtype=torch.int32)
    prompt = torch.zeros(slots, dtype=torch.int32)
    with TraceReplayState(slots, 24, device="cpu", total_len=total, prompt_len=prompt) as st:
        loop = DecodeLoop(rng, st, total, prompt, batch=batch, vocab=vocab)
        compiled = torch.compile(op_sampler, fullgraph=True, dynamic=False)
        for step in range(16):
            loop.admit_and_commit()
            logits, idx = loop.step_inputs()
            expected = loop.expected(torch.argmax(logits, dim=-1), idx)
            got = compiled(st, logits, idx)
            want = eager_sampler(st, logits, idx)
            assert_tokens_equal(got[0].numpy(), expected, f"compiled, step {step}")
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"compiled vs eager, step {step}"
            loop.advance()
        assert loop.forced > 10


def test_compiled_replay_at_step_and_explicit_lengths(rng):
    """The other op forms trace without a graph break too (Dynamo's trace, eager backend)."""
    sc, st, t = _scenario_state(rng, batch=29)
    with st:
        total, prompt = st._bound_lengths()

        def both(state, sampled, idx, step, total_len, prompt_len):
            a = replay_at_step_op(state, sampled.clone(), idx, step)
            b = replay_op(state, sampled.clone(), idx, total_len, prompt_len)
            return a, b

        a, b = torch.compile(both, fullgraph=True, backend="eager")(
            st, t["sampled"], t["idx"], t["step"], total, prompt
        )
        assert_tokens_equal(
            a.numpy(),
            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"]),
            "replay_at_step_op",
        )
        assert_tokens_equal(
            b.numpy(),
            replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], sc["total_len"], sc["prompt_len"]),
            "replay_op",
        )


def test_one_compiled_sampler_serves_two_states(rng):
    """The state id is an argument of the op: a second state reaches its own table."""
    z = torch.zeros(4, dtype=torch.int32)
    one, two = (TraceReplayState(4, 4, device="cpu", total_len=z, prompt_len=z) for _ in range(2))
    with one, two:
        one.add_request(1, [11, 12])
        two.add_request(1, [21, 22])
        one.apply_staged_writes()
        two.apply_staged_writes()
        compiled = torch.compile(op_sampler, fullgraph=True, backend="eager")
        logits = torch.from_numpy(rng.standard_normal((2, 30)).astype(np.float32))
        idx = torch.tensor([1, -1], dtype=torch.int32)
        plain = int(torch.argmax(logits[1]))
        for state, token in ((one, 11), (two, 21), (one, 11)):
            assert compiled(state, logits, idx)[0].tolist() == [token, plain]


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("sampler", [op_sampler, eager_sampler])
def test_compiled_sampler_refuses_a_closed_state(rng, sampler, fullgraph):
    """Closing a state that a compiled function holds: the next call raises the closed-state
    error as a plain ``RuntimeError`` (from the op when the graph runs), and so does a function
    compiled after the close."""
    z = torch.zeros(4, dtype=torch.int32)
    st = TraceReplayState(4, 4, device="cpu", total_len=z, prompt_len=z)
    logits = torch.from_numpy(rng.standard_normal((2, 30)).astype(np.float32))
    idx = torch.tensor([0, 1], dtype=torch.int32)
    compiled = torch.compile(sampler, fullgraph=fullgraph, backend="aot_eager")
    compiled(st, logits, idx)
    st.close()
    closed = r"^this TraceReplayState is closed \(op id \d+: closed, garbage collected or never opened\)"
    with pytest.raises(RuntimeError, match=closed) as info:
        compiled(st, logits, idx)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    with pytest.raises(RuntimeError, match=closed) as info:
        torch.compile(sampler, fullgraph=fullgraph, backend="aot_eager")(st, logits, idx)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    with pytest.raises(RuntimeError, match=r"^this TraceReplayState is closed$"):
        sampler(st, logits, idx)


def test_logprob_op_carries_gradient_of_float_outputs_only(rng):
    """As the eager function: logits that require grad give logprobs with a gradient (the same
    values as without), integer ranks without one (test_torch_logprob_grad.py checks the values)."""
    logits = torch.from_numpy(rng.standard_normal((4, 19)).astype(np.float32)).requires_grad_(True)
    tokens = torch.from_numpy(rng.integers(0, 19, 4))
    plain = token_logprob_rank(logits.detach(), tokens)
    for result in (token_logprob_rank(logits, tokens), token_logprob_rank_op(logits, tokens)):
        assert result.logprobs.requires_grad and not result.ranks.requires_grad
        assert torch.equal(result.logprobs.detach(), plain.logprobs) and torch.equal(result.ranks, plain.ranks)


def _dynamo_stats():
    return dict(torch._dynamo.utils.counters["stats"])


@pytest.mark.parametrize("dynamic, backend", [(False, "inductor"), (True, "aot_eager")])
def test_natural_sampler_compiles_whole(rng, dynamic, backend):
    """The state's own methods inside ``torch.compile(fullgraph=True)``: a sampler written with
    ``state.replay`` and ``token_logprob_rank`` (top-k, argmax, entropy) compiles into one graph;
    each step the replay is the reference replay of the tokens the compiled code drew and the
    logprob outputs are the eager function's bits for the tokens it returned; steps with
    commits between them compile nothing new after the first."""
    slots, batch, vocab = 16, 12, 97
    total = torch.zeros(slots, dtype=torch.int32)
    prompt = torch.zeros(slots, dtype=torch.int32)
    with TraceReplayState(slots, 24, device="cpu", total_len=total, prompt_len=prompt) as st:
        loop = DecodeLoop(rng, st, total, prompt, batch=batch, vocab=vocab)
        compiled = torch.compile(natural_sampler, fullgraph=True, dynamic=dynamic, backend=backend)
        torch._dynamo.utils.counters.clear()
        temperature = torch.from_numpy(rng.uniform(0.5, 1.5, batch).astype(np.float32))
        for step in range(16):  # six steps at least, and until a few rows were forced
            if step >= 6 and loop.forced > 3:
                break
            loop.admit_and_commit()
            logits, idx = loop.step_inputs()
            noise = torch.from_numpy(rng.exponential(size=(batch, vocab)).astype(np.float32))
            drawn, sampled, result = compiled(st, logits, idx, temperature, noise)
            assert_tokens_equal(sampled.numpy(), loop.expected(drawn, idx), f"replay, step {step}")
            want = token_logprob_rank(logits, sampled, top_k=4, argmax=True, entropy=True)
            assert type(result) is type(want)
            for name, g, w in zip(want._fields, result, want):
                assert g.dtype == w.dtype and torch.equal(g.nan_to_num(), w.nan_to_num()), f"{name}, step {step}"
            if step == 0:
                stats = _dynamo_stats()
                assert stats.get("unique_graphs") == 1, stats
            loop.advance()
        assert _dynamo_stats() == stats, "recompiled after the first step"
        assert loop.forced > 3


def test_natural_sampler_with_steps_and_out(rng):
    """``replay_at_step`` and ``token_logprob_rank(..., out=...)`` inside a fullgraph compile:
    the caller's tensors are written, with the eager bits."""
    sc, st, t = _scenario_state(rng, batch=29)
    with st:
        logits = torch.from_numpy(rng.standard_normal((29, 50)).astype(np.float32))

        def step_and_out(state, sampled, idx, step, logits, lp, rk):
            state.replay_at_step(sampled, idx, step)
            return token_logprob_rank(logits, sampled, out=(lp, rk))

        lp, rk = torch.full((29,), float("nan")), torch.full((29,), -7, dtype=torch.int64)
        sampled = t["sampled"].clone()
        got = torch.compile(step_and_out, fullgraph=True, backend="aot_eager")(
            st, sampled, t["idx"], t["step"], logits, lp, rk
        )
        want_tokens = replay_reference(sc["sampled"], sc["idx"], sc["table"], sc["trace_len"], step=sc["step"])
        assert_tokens_equal(sampled.numpy(), want_tokens, "replay_at_step compiled")
        want = token_logprob_rank(logits, sampled)
        assert got[0] is lp and got[1] is rk
        assert torch.equal(lp.nan_to_num(), want[0].nan_to_num()) and torch.equal(rk, want[1])


LOGPROB_OP_NAMES = [
    "token_logprob_rank" + t + a + e for t in ("", "_topk") for a in ("", "_argmax") for e in ("", "_entropy")
]


@pytest.mark.parametrize("name", LOGPROB_OP_NAMES)
def test_nograd_twins_are_the_ops_without_autograd(rng, name):
    """Each logprob op's ``_nograd`` twin: the same schema, the same bits, opcheck clean, vmap
    folds into the batch; the wrapper calls it when no gradient is wanted (outputs without a
    ``grad_fn``, and the twin's autograd is torch's fallthrough) and the differentiable op when
    one is (outputs with one)."""
    op, twin = getattr(OPS, name).default, getattr(OPS, name + "_nograd").default
    assert str(twin._schema) == str(op._schema).replace(f"{name}(", f"{name}_nograd(", 1)
    logits = torch.from_numpy(rng.standard_normal((5, 37)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, 37, 5))
    args = (logits, tokens, 4) if "_topk" in name else (logits, tokens)
    for a, b in zip(op(*args), twin(*args), strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    torch.library.opcheck(twin, args)
    stacked = torch.stack([logits, logits.flip(0)])
    mapped = torch.vmap(lambda x: tuple(twin(x, tokens, *args[2:])))(stacked)
    for a, b in zip(mapped, twin(logits.flip(0), tokens, *args[2:]), strict=True):
        assert torch.equal(a[1].nan_to_num(), b.nan_to_num())
    flags = dict(top_k=4 if "_topk" in name else 0, argmax="_argmax" in name, entropy="_entropy" in name)
    plain = token_logprob_rank_op(logits, tokens, **flags)
    assert all(t.grad_fn is None for t in plain)
    graded = token_logprob_rank_op(logits.clone().requires_grad_(True), tokens, **flags)
    assert graded.logprobs.grad_fn is not None and torch.equal(graded.logprobs.detach(), plain.logprobs)
    # the twin carries no gradient: backward through it has nothing to follow
    with pytest.raises(RuntimeError, match="does not require grad"):
        twin(logits.clone().requires_grad_(True), *args[1:])[0].sum().backward()
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(lambda x, t: token_logprob_rank_op(x, t, **flags), backend=record, fullgraph=True)(logits, tokens)
    assert any(s.endswith(f"{name}_nograd") or f"{name}_nograd." in s for s in seen), seen


TOPK_OUT_OF_RANGE = r"top_k must be between 0 and 11 \(at most 64 and at most the vocabulary, 11\) \(got -1\)"


def test_every_logprob_path_checks_top_k_as_the_eager_function(rng):
    """``top_k`` is checked once, before an op is chosen, with the eager function's message:
    compiled (before: the fake kernel's "negative dimension", naming nothing), and an integer
    that is not an ``int`` (``np.int64``) works on every path (before: a ``TypeError`` when the
    logits require grad)."""
    logits = torch.from_numpy(rng.standard_normal((3, 11)).astype(np.float32))
    tokens = torch.tensor([4, 0, 10])
    for fn in (token_logprob_rank, token_logprob_rank_op):
        with pytest.raises(ValueError, match=f"^{TOPK_OUT_OF_RANGE}$"):
            fn(logits, tokens, top_k=-1)
    compiled = torch.compile(lambda x, t: token_logprob_rank(x, t, top_k=-1), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=TOPK_OUT_OF_RANGE):  # Dynamo reports it wrapped in its own error
        compiled(logits, tokens)
    want = token_logprob_rank(logits, tokens, top_k=3)
    grad = logits.clone().requires_grad_(True)
    for got in (
        token_logprob_rank(logits, tokens, top_k=np.int64(3)),
        token_logprob_rank(grad, tokens, top_k=np.int64(3)),
        token_logprob_rank_op(logits, tokens, top_k=np.int64(3)),
        token_logprob_rank_op(grad, tokens, top_k=np.int64(3)),
    ):
        assert type(got) is type(want)
        for name, g, w in zip(type(want)._fields, got, want):
            assert torch.equal(g.detach(), w), name
