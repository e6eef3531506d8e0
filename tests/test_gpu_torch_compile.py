"""GPU tier: the registered torch ops on CUDA: opcheck, a sampler compiled with
``torch.compile(fullgraph=True)`` against the eager one bit for bit (also with each row's entropy),
and the compiled sampler inside a CUDA graph seeing the commits made between graph replays.

Skipped with a reason on machines without a GPU (see conftest.py).
"""

import pytest
import torch
from helpers import assert_tokens_equal, random_scenario  # noqa: E402
from helpers.torch_samplers import DecodeLoop, eager_sampler, natural_sampler, op_sampler  # noqa: E402

from trace_replay_torch import TraceReplayState, replay_op, token_logprob_rank_op  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
OPS = torch.ops.trace_replay


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


def _loop(rng, *, slots=48, max_len=40, batch=64, vocab=4099):
    total = torch.zeros(slots, dtype=torch.int32, device=DEV)
    prompt = torch.zeros(slots, dtype=torch.int32, device=DEV)
    st = TraceReplayState(slots, max_len, device=DEV, total_len=total, prompt_len=prompt)
    return st, DecodeLoop(rng, st, total, prompt, batch=batch, vocab=vocab)


@pytest.mark.parametrize("placement", ["device", "host_mapped"])
def test_opcheck_on_cuda(rng, placement):
    max_slots, max_len, batch = 23, 50, 77
    sc = random_scenario(rng, max_slots=max_slots, max_trace_len=max_len, batch=batch)
    total = torch.from_numpy(sc["total_len"]).to(DEV)
    prompt = torch.from_numpy(sc["prompt_len"]).to(DEV)
    with TraceReplayState(
        max_slots, max_len, device=DEV, placement=placement, total_len=total, prompt_len=prompt
    ) as st:
        for slot, tr in sc["traces"].items():
            st.add_request(slot, tr)
        st.apply_staged_writes()
        sampled = torch.from_numpy(sc["sampled"]).to(DEV)
        idx = torch.from_numpy(sc["idx"]).to(DEV)
        step = torch.from_numpy(sc["step"]).to(DEV)
        torch.library.opcheck(OPS.replay.default, (sampled.clone(), idx, total, prompt, st.op_id))
        torch.library.opcheck(OPS.replay_at_step.default, (sampled.clone(), idx, step, st.op_id))
    for dtype, vocab in ((torch.float32, 1000), (torch.bfloat16, 151_936)):
        logits = torch.randn(batch, vocab, device=DEV).to(dtype)
        tokens = torch.from_numpy(rng.integers(0, vocab, batch)).to(DEV)
        torch.library.opcheck(OPS.token_logprob_rank.default, (logits, tokens))
        temperature = torch.rand(batch, device=DEV) + 0.5
        torch.library.opcheck(OPS.token_logprob_rank.default, (logits, tokens, temperature))
        torch.library.opcheck(OPS.token_logprob_rank_topk.default, (logits, tokens, 20, temperature))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_sampler_matches_eager_bit_for_bit(rng, mode):
    """Sixty steps with requests admitted, finished and committed between them: the compiled
    sampler's tokens, logprobs and ranks equal the eager sampler's exactly, and the tokens the
    reference replay. ``reduce-overhead`` runs the steps as CUDA graph replays."""
    from torch._dynamo.utils import counters

    counters.clear()
    st, loop = _loop(rng)
    with st:
        compiled = torch.compile(op_sampler, fullgraph=True, dynamic=False, mode=mode)
        for step in range(60):
            loop.admit_and_commit()
            logits, idx = loop.step_inputs()
            expected = loop.expected(torch.argmax(logits, dim=-1), idx)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            got = [t.clone() for t in compiled(st, logits, idx)]
            want = eager_sampler(st, logits, idx)
            assert_tokens_equal(got[0].cpu().numpy(), expected, f"compiled, step {step}")
            for name, g, w in zip(("tokens", "logprobs", "ranks"), got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name} differ at step {step}"
            loop.advance()
        assert loop.forced > 200
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_compiled_sampler_in_cuda_graph_sees_commits(rng):
    """The compiled sampler captured with ``torch.cuda.graph`` (its replay and logprob ops bind
    during the capture, at the graph pool's addresses); commits between graph replays reach it."""
    st, loop = _loop(rng, batch=40)
    with st:
        compiled = torch.compile(op_sampler, fullgraph=True, dynamic=False)
        logits, idx = loop.step_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile, and the kernels' first launches
                compiled(st, logits, idx)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(st, logits, idx)
        for rnd in range(25):
            loop.admit_and_commit()  # outside the graph, on the current stream
            fresh_logits, fresh_idx = loop.step_inputs()
            logits.copy_(fresh_logits)
            idx.copy_(fresh_idx)
            expected = loop.expected(torch.argmax(logits, dim=-1), idx)
            graph.replay()
            assert_tokens_equal(out[0].cpu().numpy(), expected, f"graph replay {rnd}")
            want = eager_sampler(st, logits.clone(), idx.clone())
            for name, g, w in zip(("tokens", "logprobs", "ranks"), out, want):
                assert torch.equal(g, w), f"{name} differ at graph replay {rnd}"
            loop.advance()
        assert loop.forced > 50
        torch.cuda.synchronize()
        del graph  # before the state's table is freed


def _entropy_sampler(state, logits, idx_mapping, temperature):
    """Greedy sample, replay, score with each row's entropy: through the registered ops."""
    sampled = torch.argmax(logits, dim=-1)
    replay_op(state, sampled, idx_mapping)
    logprobs, ranks, entropy = token_logprob_rank_op(logits, sampled, temperature=temperature, entropy=True)
    return sampled, logprobs, ranks, entropy


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_sampler_with_entropy_matches_eager(rng, mode):
    """The sampler with ``entropy=True`` compiled (``fullgraph=True``; ``reduce-overhead``: CUDA
    graph replays) over steps with commits between them: its tokens, logprobs, ranks and
    entropies have the bits of the eager calls, and its entropies match the float64 reference."""
    from helpers.entropy_cases import assert_entropy

    from trace_replay_torch import token_logprob_rank

    torch.library.opcheck(
        OPS.token_logprob_rank_entropy.default,
        (torch.randn(8, 151_936, device=DEV).bfloat16(), torch.randint(0, 151_936, (8,), device=DEV)),
    )
    st, loop = _loop(rng, batch=48)
    with st:
        compiled = torch.compile(_entropy_sampler, fullgraph=True, dynamic=False, mode=mode)
        temperature = torch.rand(48, device=DEV) + 0.5
        for step in range(12):
            loop.admit_and_commit()
            logits, idx = loop.step_inputs()
            expected = loop.expected(torch.argmax(logits, dim=-1), idx)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            got = [t.clone() for t in compiled(st, logits, idx, temperature)]
            assert_tokens_equal(got[0].cpu().numpy(), expected, f"compiled, step {step}")
            want = token_logprob_rank(logits, got[0], temperature=temperature, entropy=True)
            for name, g, w in zip(("logprobs", "ranks", "entropy"), got[1:], want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name} differ at step {step}"
            y = (logits.float() / temperature[:, None]).cpu().numpy()
            assert_entropy(y, got[3].cpu().numpy(), f"compiled entropy, step {step}")
            loop.advance()


@pytest.mark.parametrize(
    "mode, dynamic", [("default", False), ("default", True), ("reduce-overhead", False), ("reduce-overhead", True)]
)
def test_natural_sampler_compiled_on_cuda(rng, mode, dynamic):
    """A sampler written with the state's own methods (temperature, top-k, an exponential race,
    ``state.replay``, ``token_logprob_rank`` with top-k, argmax and entropy) under
    ``torch.compile(fullgraph=True)``: each step's replay is the reference replay of what the
    compiled code drew, its logprob outputs have the eager bits for the tokens it returned, no
    step after the first compiles anything, and ``reduce-overhead`` runs it as CUDA graphs."""
    from torch._dynamo.utils import counters

    from trace_replay_torch import token_logprob_rank

    st, loop = _loop(rng, batch=48)
    with st:
        compiled = torch.compile(natural_sampler, fullgraph=True, dynamic=dynamic, mode=mode)
        temperature = torch.rand(48, device=DEV) + 0.5
        counters.clear()
        for step in range(16):
            loop.admit_and_commit()
            logits, idx = loop.step_inputs(dtype=torch.bfloat16)
            noise = torch.empty(logits.shape, device=DEV).exponential_()
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            drawn, sampled, result = compiled(st, logits, idx, temperature, noise)
            drawn, sampled, result = drawn.clone(), sampled.clone(), [t.clone() for t in result]
            assert_tokens_equal(sampled.cpu().numpy(), loop.expected(drawn, idx), f"replay, step {step}")
            want = token_logprob_rank(logits, sampled, top_k=4, argmax=True, entropy=True)
            for name, g, w in zip(want._fields, result, want):
                assert g.dtype == w.dtype and torch.equal(g.nan_to_num(), w.nan_to_num()), f"{name}, step {step}"
            if step == 1:
                stats = dict(counters["stats"])
            loop.advance()
        assert dict(counters["stats"]) == stats, "compiled again after the first steps"
        assert loop.forced > 10
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
