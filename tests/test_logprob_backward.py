"""token_logprob_rank_backward on the CPU: the numpy backend and the Triton kernels (in Triton's
interpreter, launched as on a GPU, on poisoned buffers) against float64 ``torch.log_softmax``
autograd; the same bits for a row at batch 1, 3 and 100; special rows; refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.backward_cases import RTOL, assert_grads, check_special, make_backward_case, reference_grads, special_case
from helpers.backward_interpreter import run_backward_cases

from trace_replay_core import logprob_backward_workspace_bytes, token_logprob_rank_backward

# name -> options of make_backward_case (batch 5 unless said)
OPTIONS = {
    "plain": {},
    "temp-gradT": dict(temp=True, grad_t=True),
    "topk": dict(top_k=4),
    "topk-only": dict(top_k=4, grads=("gk",)),
    "entropy": dict(entropy=True),
    "entropy-only-temp": dict(entropy=True, grads=("ge",), temp=True, grad_t=True),
    "all": dict(temp=True, grad_t=True, top_k=3, entropy=True, argmax=True, invalid_rows=(1,)),
    "argmax-greedy-rows": dict(argmax=True, invalid_rows=(0, 3)),
    "invalid-rows": dict(invalid_rows=(2,)),
    "invalid-row-entropy": dict(entropy=True, invalid_rows=(2,)),
}
DTYPES = ("float32", "bfloat16", "float16")


def _numpy_call(case, out_dtype_grad=None):
    x = case["x"]
    if case["dtype"] != "float32":
        import torch
        from helpers.logprob_cases import TORCH_DTYPES

        logits = torch.from_numpy(x).to(TORCH_DTYPES[case["dtype"]])
        grad = torch.full_like(logits, float("nan"))
    else:
        logits, grad = x, np.full_like(x, np.nan)
    grad_t = np.full(x.shape[0], np.nan, np.float32) if case.get("grad_t") else None
    token_logprob_rank_backward(
        logits, case["ids"], case["lp"], grad_logprobs=case.get("g"), temperature=case.get("temp"),
        out_grad_temperature=grad_t, argmax=case.get("am"), topk_ids=case.get("tid"), topk_logprobs=case.get("tlp"),
        grad_topk_logprobs=case.get("gk"), entropy=case.get("ent") if case.get("ge") is not None else None,
        grad_entropy=case.get("ge"), out_grad_logits=grad, stream=0,
    )  # fmt: skip
    g = grad if isinstance(grad, np.ndarray) else grad.float().numpy()
    return g, grad_t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_numpy_backend_matches_autograd(rng, name, dtype):
    case = make_backward_case(rng, 5, 97, dtype, name=name, **OPTIONS[name])
    grad, grad_t = _numpy_call(case)
    assert_grads(case, grad, grad_t, f"numpy {name} {dtype}")


def _interp_cases():
    rng = np.random.default_rng(21)
    cases = []
    for name, options in OPTIONS.items():
        for dtype in ("float32", "bfloat16"):
            # vocab 700 in blocks of 128 and chunks of 2 blocks: 3 chunks, the last a partial block
            cases.append(
                make_backward_case(rng, 5, 700, dtype, name=f"{name}-{dtype}", **options)
                | dict(block=128, chunk_blocks=2)
            )
    # layouts: padded rows, an unaligned start (float16), one block per chunk, the real block
    for extra in (dict(pad=3), dict(pad=5, shift=1), dict(chunk_blocks=1)):
        tag = "-".join(f"{k}{v}" for k, v in extra.items())
        case = make_backward_case(rng, 4, 500, "float16", name=f"layout-{tag}", temp=True, grad_t=True, top_k=2)
        cases.append(case | dict(block=128) | extra)
    cases.append(make_backward_case(rng, 2, 5000, "bfloat16", name="real-block", entropy=True, top_k=5))
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    cases = _interp_cases()
    return cases, run_backward_cases(cases, str(tmp_path_factory.mktemp("bwd")))


def test_kernels_in_interpreter_match_autograd(interpreted):
    cases, out = interpreted
    for case in cases:
        got = out[case["name"]]
        assert_grads(case, got["grad"], got.get("grad_t"), f"interpreter {case['name']}")
        if case.get("block") == 128 and case.get("chunk_blocks") == 2:
            assert got["plan"][2] == -(-case["x"].shape[1] // 256), case["name"]
        # the numpy twin agrees to the dtype's rounding: twice the reference tolerance for bf16/fp16
        # (measured 2026-12-05 on the CPU: at most 0.0077 relative for bf16, 0 for fp16 beyond atol)
        want, want_t = _numpy_call(case)
        np.testing.assert_allclose(
            got["grad"],
            want,
            rtol=2 * RTOL[case["dtype"]] if case["dtype"] != "float32" else 1e-5,
            atol=1e-6,
            err_msg=case["name"],
        )


def test_batch_invariance_bitwise(tmp_path):
    """A row's gradient and temperature gradient have the same bits at batch 1, 3 and 100."""
    rng = np.random.default_rng(3)
    big = make_backward_case(rng, 100, 300, "bfloat16", name="b100", temp=True, grad_t=True, top_k=3, entropy=True)
    cases = [big]
    for n in (1, 3):
        small = {k: (v[:n] if isinstance(v, np.ndarray) else v) for k, v in big.items()}
        cases.append(small | dict(name=f"b{n}"))
    common = dict(block=128, chunk_blocks=1)
    out = run_backward_cases([c | common for c in cases], str(tmp_path))
    for n in (1, 3):
        assert out[f"b{n}"]["grad"].tobytes() == out["b100"]["grad"][:n].tobytes(), n
        assert out[f"b{n}"]["grad_t"].tobytes() == out["b100"]["grad_t"][:n].tobytes(), n
    assert_grads(big, out["b100"]["grad"], out["b100"]["grad_t"], "b100")


def test_special_rows_numpy():
    case = special_case()
    grad, grad_t = _numpy_call(case)
    check_special(case, grad, grad_t, "numpy")


def test_special_rows_interpreter(tmp_path):
    case = special_case() | dict(block=128, chunk_blocks=1)
    out = run_backward_cases([case], str(tmp_path))["case"]
    check_special(case, out["grad"], out["grad_t"], "interpreter")


def test_reference_is_not_the_library():
    """The reference is independent: a planted wrong gradient (one-hot minus softmax at T = 1 while
    the case has a temperature) is caught by assert_grads."""
    rng = np.random.default_rng(4)
    case = make_backward_case(rng, 3, 50, "float32", temp=True, grads=("g",))
    ref, _ = reference_grads(case)
    with pytest.raises(AssertionError, match="gradients off"):
        assert_grads(case, ref * case["temp"][:, None], None, "planted")


def _strided_rows(row_stride):
    """A writable float32 [3, 10] over one buffer (7.0 everywhere) whose rows start ``row_stride`` elements apart."""
    buf = np.full(40, 7.0, np.float32)
    return np.lib.stride_tricks.as_strided(buf, shape=(3, 10), strides=(4 * row_stride, 4), writeable=True)


def _bad_calls():
    x = np.ones((3, 10), np.float32)
    ids, lp = np.zeros(3, np.int64), np.zeros(3, np.float32)
    g = np.empty_like(x)
    tid, tlp = np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32)
    return (
        {
            "grad-dtype": (
                dict(out_grad_logits=np.zeros((3, 10), np.float16)),
                TypeError,
                r"^out_grad_logits must have dtype float32",
            ),
            "grad-shape": (
                dict(out_grad_logits=np.empty((3, 9), np.float32)),
                ValueError,
                r"^out_grad_logits must have the logits' shape",
            ),
            "lp-length": (dict(logprobs=np.zeros(2, np.float32)), ValueError, r"^logprobs must have 3 rows"),
            "grad-lp-dtype": (dict(grad_logprobs=np.zeros(3)), TypeError, r"^grad_logprobs must have dtype float32"),
            "grad-t-without-t": (
                dict(out_grad_temperature=np.zeros(3, np.float32)),
                ValueError,
                r"^out_grad_temperature needs temperature",
            ),
            "entropy-missing": (
                dict(grad_entropy=np.zeros(3, np.float32)),
                ValueError,
                r"^entropy must be given with grad_entropy",
            ),
            "topk-half": (dict(topk_ids=tid), ValueError, r"^topk_ids and topk_logprobs must be given together"),
            "topk-grad-alone": (dict(grad_topk_logprobs=tlp), ValueError, r"^grad_topk_logprobs needs topk_ids"),
            "topk-grad-shape": (
                dict(topk_ids=tid, topk_logprobs=tlp, grad_topk_logprobs=np.zeros((3, 3), np.float32)),
                ValueError,
                r"^grad_topk_logprobs must have shape \[3, 2\]",
            ),
            "aliased": (dict(out_grad_logits=x), ValueError, r"^out_grad_logits and logits overlap in memory"),
            "logprobs-none": (
                dict(logprobs=None),
                ValueError,
                r"^logprobs must be given: the forward's \[batch\] float32 logprobs \(got None\)$",
            ),
            # rows 7 elements apart over a vocabulary of 10 (or all on one row): they overlap
            "grad-rows-overlap": (
                dict(out_grad_logits=_strided_rows(7)),
                ValueError,
                r"^out_grad_logits must not have overlapping rows: .* \(got element strides \[7, 1\]\)$",
            ),
            "grad-rows-stride-0": (
                dict(out_grad_logits=_strided_rows(0)),
                ValueError,
                r"^out_grad_logits must not have overlapping rows: .* \(got element strides \[0, 1\]\)$",
            ),
            "stream-none": (dict(stream=None), TypeError, r"stream"),
        },
        x,
        ids,
        lp,
        g,
    )


@pytest.mark.parametrize("name", sorted(_bad_calls()[0]))
def test_refusals_change_nothing(name):
    table, x, ids, lp, g = _bad_calls()
    override, exc, pattern = table[name]
    g[:] = 7.0
    args = dict(logprobs=lp, out_grad_logits=g, stream=0) | override
    logprobs = args.pop("logprobs")
    before = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(exc, match=pattern):
        token_logprob_rank_backward(x, ids, logprobs, **args)
    assert (g == 7.0).all()
    assert all(np.array_equal(args[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    "args, exc, pattern",
    [
        ((4, 0, True), ValueError, r"^vocab must be between 1 and 1073741824 \(got 0\)$"),
        ((4, -7, True), ValueError, r"^vocab must be between 1 and 1073741824 \(got -7\)$"),
        ((4, 1000.0, True), TypeError, r"^vocab must be an int \(got float 1000\.0\)$"),
        ((-3, 1000, True), ValueError, r"^batch must be between 0 and 2147483647 \(got -3\)$"),
        ((2.5, 1000, False), TypeError, r"^batch must be an int \(got float 2\.5\)$"),
        ((4, 1000, "yes"), TypeError, r"^grad_temperature must be True or False \(got 'yes'\)$"),
    ],
)
def test_workspace_bytes_refusals(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        logprob_backward_workspace_bytes(*args)


def test_inputs_may_share_memory(rng):
    """Reading the same memory twice is harmless: one upstream gradient array given as both
    grad_logprobs and grad_entropy gives what two copies give."""
    case = make_backward_case(rng, 4, 60, "float32", entropy=True)
    g = np.array([0.5, -1.25, 2.0, 0.75], np.float32)
    got, want = np.full_like(case["x"], np.nan), np.full_like(case["x"], np.nan)
    common = dict(entropy=case["ent"], stream=0)
    token_logprob_rank_backward(
        case["x"], case["ids"], case["lp"], grad_logprobs=g, grad_entropy=g, out_grad_logits=got, **common
    )
    token_logprob_rank_backward(
        case["x"],
        case["ids"],
        case["lp"],
        grad_logprobs=g.copy(),
        grad_entropy=g.copy(),
        out_grad_logits=want,
        **common,
    )
    assert got.tobytes() == want.tobytes() and np.all(np.isfinite(got))


def test_workspace_bytes():
    assert logprob_backward_workspace_bytes(256, 151936) == 0
    assert logprob_backward_workspace_bytes(256, 151936, True) == 4 * 256 * 19
    assert logprob_backward_workspace_bytes(0, 151936, True) == 0


@pytest.mark.parametrize("batch", [3, 0])
def test_bound_backward_has_its_own_type(rng, batch):
    """bind_logprob_rank_backward returns a BoundLogprobBackward, whose docstring is the
    backward's; it stays a BoundLogprobRank (release() and calls as the forward's)."""
    from trace_replay_core import BoundLogprobBackward, BoundLogprobRank, bind_logprob_rank_backward

    case = make_backward_case(rng, batch, 10, "float32")
    grad = np.empty_like(case["x"])
    bound = bind_logprob_rank_backward(case["x"], case["ids"], case["lp"], out_grad_logits=grad, stream=0)
    assert type(bound) is BoundLogprobBackward and isinstance(bound, BoundLogprobRank)
    assert "bind_logprob_rank_backward" in BoundLogprobBackward.__doc__
    assert "bind_logprob_rank`" not in BoundLogprobBackward.__doc__


def test_bound_call_repeats_the_call(rng):
    """bind_logprob_rank_backward: the bound call reads the arrays' current values each time."""
    from trace_replay_core import bind_logprob_rank_backward

    case = make_backward_case(rng, 4, 60, "float32", temp=True, grad_t=True)
    grad, grad_t = np.full_like(case["x"], np.nan), np.full(4, np.nan, np.float32)
    g = case["g"].copy()
    bound = bind_logprob_rank_backward(
        case["x"], case["ids"], case["lp"], grad_logprobs=g, temperature=case["temp"], out_grad_temperature=grad_t,
        out_grad_logits=grad, stream=0,
    )  # fmt: skip
    bound(stream=0)
    assert_grads(case, grad, grad_t, "bound")
    g *= -2.0
    case["g"] = g
    bound(stream=0)
    assert_grads(case, grad, grad_t, "bound, new upstream gradient")
