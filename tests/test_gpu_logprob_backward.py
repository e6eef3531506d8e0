"""The logprob op's backward on the GPU (marked ``gpu``, skipped without one): the core's kernel
against float64 ``torch.log_softmax`` autograd at decode vocabularies (151,936 bfloat16, 50,257
unaligned float32, 32,000 float16) on poisoned, padded buffers; the same bits at batch 1, 3, 100
and 513; special rows; torch autograd (eager, op, ``torch.compile``) in float32 and bfloat16; JAX
``grad`` and ``vmap`` of the kernel method; temperatures that are not finite and > 0 in every
method of both frameworks on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.backward_cases import assert_grads, check_special, make_backward_case, special_case
from helpers.logprob_cases import TORCH_DTYPES
from helpers.temperature_cases import CASES as TEMPERATURES
from helpers.temperature_cases import assert_temperature_results, case_data, jax_methods, torch_methods

from trace_replay_core import (
    logprob_backward_workspace_bytes,
    logprob_rank_workspace_bytes,
    token_logprob_rank,
    token_logprob_rank_backward,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def _padded(x: np.ndarray, dtype: str, pad: int, fill: float):
    """``(buffer, view)``: a ``[batch, vocab]`` CUDA view of rows ``vocab + pad`` long, everything
    else ``fill``; ``x`` None leaves the view ``fill`` too."""
    batch, vocab = x.shape
    buf = torch.full((batch, vocab + pad), fill, dtype=TORCH_DTYPES[dtype], device="cuda")
    buf[:, :vocab] = torch.from_numpy(x).to(buf.dtype)
    return buf, buf[:, :vocab]


def gpu_forward_backward(case: dict, *, top_k=0, entropy=False, argmax=False, pad=0):
    """The GPU forward (its outputs replace the case's, for the reference's top-k ids) and the GPU
    backward into a NaN-poisoned padded gradient; returns (grad float32 numpy, grad_t or None)."""
    x, ids, dtype = case["x"], case["ids"], case["dtype"]
    batch, vocab = x.shape
    dev = "cuda"
    _, logits = _padded(x, dtype, pad, float("nan"))
    tok = torch.from_numpy(ids).to(dev)
    temp = None if case.get("temp") is None else torch.from_numpy(case["temp"]).to(dev)
    lp, rk = torch.empty(batch, device=dev), torch.empty(batch, dtype=torch.int64, device=dev)
    tlp = torch.empty(batch, top_k, device=dev) if top_k else None
    tid = torch.empty(batch, top_k, dtype=torch.int64, device=dev) if top_k else None
    ent = torch.empty(batch, device=dev) if entropy else None
    am = torch.empty(batch, dtype=torch.int64, device=dev) if argmax else None
    ws = torch.empty(max(16, logprob_rank_workspace_bytes(batch, vocab, top_k)), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    token_logprob_rank(
        logits, tok, out_logprobs=lp, out_ranks=rk, stream=stream, workspace=ws, temperature=temp, top_k=top_k,
        out_topk_logprobs=tlp, out_topk_ids=tid, out_entropy=ent, out_argmax=am,
    )  # fmt: skip
    for key, value in (("lp", lp), ("tlp", tlp), ("tid", tid), ("ent", ent), ("am", am)):
        case[key] = None if value is None else value.cpu().numpy()
    grad_buf, grad = _padded(np.zeros_like(x), dtype, pad, float("nan"))
    grad.fill_(float("nan"))  # poison: an element the backward does not write stays NaN
    grad_t = torch.full((batch,), float("nan"), device=dev) if case.get("grad_t") else None
    nbytes = logprob_backward_workspace_bytes(batch, vocab, grad_t is not None)
    bws = torch.empty(max(16, nbytes), dtype=torch.uint8, device=dev)

    def dev_or_none(key):
        return None if case.get(key) is None else torch.from_numpy(case[key]).to(dev)

    token_logprob_rank_backward(
        logits, tok, lp, out_grad_logits=grad, stream=stream, grad_logprobs=dev_or_none("g"), temperature=temp,
        out_grad_temperature=grad_t, argmax=am, topk_ids=tid, topk_logprobs=tlp,
        grad_topk_logprobs=dev_or_none("gk"), entropy=ent if case.get("ge") is not None else None,
        grad_entropy=dev_or_none("ge"), workspace=bws,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isnan(grad_buf[:, vocab:].float()).all(), "the backward wrote past the vocabulary"
    return grad.float().cpu().numpy(), None if grad_t is None else grad_t.cpu().numpy()


SHAPES = ((7, 151936, "bfloat16", 0), (5, 50257, "float32", 3), (6, 32000, "float16", 8))
OPTIONS = {
    "plain": (dict(), {}),
    "temp-gradT": (dict(temp=True, grad_t=True), {}),
    "topk-entropy-argmax": (
        dict(top_k=5, entropy=True, argmax=True, invalid_rows=(2,)),
        dict(top_k=5, entropy=True, argmax=True),
    ),
    "all": (
        dict(temp=True, grad_t=True, top_k=20, entropy=True, invalid_rows=(1,)),
        dict(top_k=20, entropy=True),
    ),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}-pad{s[3]}")
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_core_backward_matches_autograd(rng, shape, name):
    batch, vocab, dtype, pad = shape
    options, flags = OPTIONS[name]
    case = make_backward_case(rng, batch, vocab, dtype, **options)
    grad, grad_t = gpu_forward_backward(case, pad=pad, **flags)
    assert_grads(case, grad, grad_t, f"gpu {name} {shape}")


def test_batch_invariance_bitwise(rng):
    """A row's gradient and temperature gradient have the same bits at batch 1, 3, 100 and 513."""
    big = make_backward_case(rng, 513, 151936, "bfloat16", temp=True, grad_t=True, top_k=4, entropy=True)
    flags = dict(top_k=4, entropy=True)
    grad, grad_t = gpu_forward_backward(big, **flags)
    for n in (1, 3, 100):
        small = {k: (v[:n] if isinstance(v, np.ndarray) else v) for k, v in big.items()}
        g, gt = gpu_forward_backward(small, **flags)
        assert g.tobytes() == grad[:n].tobytes() and gt.tobytes() == grad_t[:n].tobytes(), n
    assert_grads(big, grad, grad_t, "gpu 513", rows=np.arange(0, 513, 37))


def test_special_rows():
    case = special_case()
    grad, grad_t = gpu_forward_backward(case, entropy=True)
    check_special(case, grad, grad_t, "gpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("how", ["eager", "op", "compiled"])
def test_torch_autograd(rng, dtype, how):
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank
    from trace_replay_torch import token_logprob_rank_op

    case = make_backward_case(rng, 64, 151936, dtype, temp=True, grad_t=True, top_k=3, entropy=True)
    logits = torch.from_numpy(case["x"]).to("cuda", TORCH_DTYPES[dtype]).requires_grad_(True)
    temp = torch.from_numpy(case["temp"]).cuda().requires_grad_(True)
    ids = torch.from_numpy(case["ids"]).cuda()
    g, gk, ge = (torch.from_numpy(case[k]).cuda() for k in ("g", "gk", "ge"))

    def loss(a, t):
        fn = torch_logprob_rank if how == "eager" else token_logprob_rank_op
        r = fn(a, ids, temperature=t, top_k=3, entropy=True)
        return (r.logprobs * g).sum() + (r.topk_logprobs * gk).sum() + (r.entropy * ge).sum(), r.topk_ids

    if how == "compiled":
        loss = torch.compile(loss, fullgraph=True)
    value, tid = loss(logits, temp)
    value.backward()
    case["tid"] = tid.cpu().numpy()
    assert_grads(case, logits.grad.float().cpu().numpy(), temp.grad.cpu().numpy(), f"torch {how} {dtype}")
    # against torch's own log_softmax autograd in the same dtype, as a user would write it
    ref_logits = logits.detach().clone().requires_grad_(True)
    ls = torch.log_softmax(ref_logits.float() / temp.detach()[:, None], -1)
    ref = (
        (ls.gather(1, ids[:, None])[:, 0] * g).sum()
        + (ls.gather(1, tid) * gk).sum()
        - ((ls.exp() * ls).sum(-1) * ge).sum()
    )
    ref.backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=1e-5, rtol=2.0**-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_grad_and_vmap(rng, dtype):
    import jax
    import jax.numpy as jnp
    from helpers.jax_helpers import jax_gpu

    from trace_replay_jax import token_logprob_rank as jax_logprob_rank

    gpu = jax_gpu()
    case = make_backward_case(rng, 32, 151936, dtype, temp=True, grad_t=True, entropy=True)
    x = jax.device_put(jnp.asarray(case["x"], jnp.dtype(dtype)), gpu)
    ids = jax.device_put(jnp.asarray(case["ids"], jnp.int32), gpu)
    t = jax.device_put(jnp.asarray(case["temp"]), gpu)

    def loss(a, temp):
        r = jax_logprob_rank(a, ids, temperature=temp, entropy=True)
        return (r.logprobs * case["g"]).sum() + (r.entropy * case["ge"]).sum()

    gx, gt = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, t)
    assert_grads(case, np.asarray(gx, np.float32), np.asarray(gt), f"jax gpu {dtype}")
    xb = jnp.stack([x[:8], x[8:16]])
    vg = jax.vmap(jax.jit(jax.grad(lambda a: jax_logprob_rank(a, ids[:8]).logprobs.sum())))(xb)
    want = jax.vmap(jax.grad(lambda a: jax_logprob_rank(a, ids[:8], method="jnp").logprobs.sum()))(xb)
    np.testing.assert_allclose(np.asarray(vg, np.float32), np.asarray(want, np.float32), atol=1e-5, rtol=2.0**-7)


@pytest.mark.parametrize("case", sorted(TEMPERATURES))
def test_bad_temperature_every_method_on_gpu(case):
    from helpers.jax_helpers import jax_gpu

    methods = {**torch_methods("cuda"), **jax_methods(jax_gpu())}
    x, ids = case_data()
    for name, method in methods.items():
        res = method(x, ids, TEMPERATURES[case])
        assert_temperature_results(x, ids, TEMPERATURES[case], *res, what=f"gpu {name} {case}")


def test_torch_backward_bound_per_layout_reads_new_values(rng):
    """The torch backward binds once per tensor layout: later calls at the same addresses (torch's
    allocator) must read the new values, not the first call's."""
    from trace_replay_torch import token_logprob_rank as torch_logprob_rank

    x = torch.from_numpy(make_backward_case(rng, 16, 151936, "bfloat16")["x"]).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 151936, (16,), device="cuda")
    logits = x.clone().requires_grad_(True)
    for step in range(3):
        g = torch.randn(16, device="cuda")
        with torch.no_grad():
            logits.copy_(x * (1 + 0.1 * step))
        (grad,) = torch.autograd.grad((torch_logprob_rank(logits, ids).logprobs * g).sum(), logits)
        ref_logits = logits.detach().float().requires_grad_(True)
        (ref,) = torch.autograd.grad(
            (torch.log_softmax(ref_logits, -1).gather(1, ids[:, None])[:, 0] * g).sum(), ref_logits
        )
        torch.testing.assert_close(grad.float(), ref, atol=1e-5, rtol=2.0**-7, msg=f"step {step}")


def test_bound_backward_in_a_cuda_graph(rng):
    """A bound backward (compiled first) captured in a CUDA graph gives the eager call's bits."""
    from trace_replay_core import bind_logprob_rank_backward

    case = make_backward_case(rng, 8, 151936, "bfloat16", temp=True, grad_t=True)
    eager, eager_t = gpu_forward_backward(case)
    dev = "cuda"
    logits = torch.from_numpy(case["x"]).to(dev, torch.bfloat16)
    tensors = {k: torch.from_numpy(case[k]).to(dev) for k in ("ids", "lp", "g", "temp")}
    grad = torch.full_like(logits, float("nan"))
    grad_t = torch.full((8,), float("nan"), device=dev)
    ws = torch.empty(max(16, logprob_backward_workspace_bytes(8, 151936, True)), dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        bound = bind_logprob_rank_backward(
            logits, tensors["ids"], tensors["lp"], grad_logprobs=tensors["g"], temperature=tensors["temp"],
            out_grad_temperature=grad_t, out_grad_logits=grad, workspace=ws, stream=side.cuda_stream,
        )  # fmt: skip
        bound(stream=side.cuda_stream)  # compiled before capture
    torch.cuda.synchronize()
    grad.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound(stream=torch.cuda.current_stream().cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    assert grad.float().cpu().numpy().tobytes() == eager.tobytes()
    assert grad_t.cpu().numpy().tobytes() == eager_t.tobytes()
