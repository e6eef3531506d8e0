"""Run the logprob backward's kernels in Triton's interpreter, as the GPU path launches them.

As :mod:`helpers.logprob_interpreter`: the parent (:func:`run_backward_cases`) writes the cases,
starts this module as a child with ``TRITON_INTERPRET=1``, and reads the results back; the child
lays every array out in its own poisoned torch CPU buffer (NaN in the gradient, also in the
padding of strided rows), builds :class:`LogprobBackwardArgs` and launches exactly the kernels of
the call's plan (:func:`plan_for_backward`, :func:`kernel_specs`, :func:`call_arguments`).

A case: ``name``, ``x`` (float32, exact in ``dtype``), ``ids``, the forward's ``lp`` and optional
``tlp``/``tid``/``ent``/``am``, upstream ``g``/``gk``/``ge`` (each optional), optional ``temp`` and
``grad_t`` (bool), and options ``dtype``, ``pad``, ``shift``, ``block``, ``chunk_blocks``.
Results: ``{"grad": float32 [batch, vocab], "grad_t": float32 [batch] (with grad_t), "plan"}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ARRAYS = ("x", "ids", "lp", "tlp", "tid", "ent", "am", "g", "gk", "ge", "temp")
OPTIONS = ("dtype", "pad", "shift", "block", "chunk_blocks", "grad_t")


def run_backward_cases(cases: list[dict], tmp_dir: str) -> dict[str, dict]:
    in_path, out_path = os.path.join(tmp_dir, "bcases"), os.path.join(tmp_dir, "bout.npz")
    meta = [
        {k: c[k] for k in ("name",) + OPTIONS if k in c} | {"arrays": [a for a in ARRAYS if c.get(a) is not None]}
        for c in cases
    ]
    with open(in_path + ".json", "w") as f:
        json.dump(meta, f)
    arrays: dict = {f"{a}{i}": np.asarray(c[a]) for i, c in enumerate(cases) for a in ARRAYS if c.get(a) is not None}
    np.savez(in_path + ".npz", **arrays)
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    env["PYTHONPATH"] = os.pathsep.join(
        [root, os.path.join(root, "adapters"), tests] + env.get("PYTHONPATH", "").split(os.pathsep)
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), in_path, out_path],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = np.load(out_path)
    return {
        c["name"]: {k: out[f"{k}{i}"] for k in ("grad", "grad_t", "plan") if f"{k}{i}" in out}
        for i, c in enumerate(cases)
    }


def run_case(a: dict, case: dict) -> dict:
    """Child side: one backward through the interpreter."""
    import torch

    from helpers.logprob_interpreter import _Buffers, _torch_dtypes
    from trace_replay_core.kernels.logprob_backward import (
        LogprobBackwardArgs,
        LogprobBackwardDtypes,
        call_arguments,
        kernel_specs,
        plan_for_backward,
    )

    td = _torch_dtypes()
    dtype = case.get("dtype", "float32")
    pad, shift = case.get("pad", 0), case.get("shift", 0)
    x = a["x"]
    batch, vocab = x.shape
    stride = vocab + pad
    itemsize = td[dtype].itemsize
    bufs = _Buffers()
    logits = bufs.new(batch * stride * itemsize, shift_bytes=shift * itemsize).view(td[dtype]).view(batch, stride)
    logits.fill_(float("nan"))
    logits[:, :vocab] = torch.from_numpy(x).to(td[dtype])
    grad = bufs.new(batch * stride * itemsize, shift_bytes=shift * itemsize).view(td[dtype]).view(batch, stride)
    grad.fill_(float("nan"))

    def put(name, dt):
        if name not in a:
            return None
        arr = np.asarray(a[name])
        t = bufs.new(max(arr.size, 1) * td[dt].itemsize).view(td[dt])[: arr.size]
        t.copy_(torch.from_numpy(arr.reshape(-1)).to(td[dt]))
        return t

    ids, am, tid = put("ids", "int64"), put("am", "int64"), put("tid", "int64")
    f32 = {k: put(k, "float32") for k in ("lp", "tlp", "ent", "g", "gk", "ge", "temp")}
    grad_t = bufs.new(4 * batch).view(torch.float32) if case.get("grad_t") else None
    if grad_t is not None:
        grad_t.fill_(float("nan"))
    top_k = a["tid"].shape[1] if "tid" in a else 0

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    args = LogprobBackwardArgs(
        logits.data_ptr(), ids.data_ptr(), ptr(am), ptr(f32["temp"]), ptr(f32["lp"]), ptr(f32["g"]), ptr(tid),
        ptr(f32["tlp"]), ptr(f32["gk"]), ptr(f32["ent"]), ptr(f32["ge"]), grad.data_ptr(), ptr(grad_t), 0,
        batch, vocab, stride, stride, top_k,
    )  # fmt: skip
    dtypes = LogprobBackwardDtypes(dtype, "int64", "int64", "int64")
    overrides = {k: case[k] for k in ("block", "chunk_blocks") if case.get(k) is not None}
    variant = plan_for_backward(args, dtypes, **overrides)
    ws = bufs.new(4 * batch * variant.n_chunks + 16)
    args = args._replace(workspace=ws.data_ptr())
    for spec, (grid, ptrs, ints) in zip(kernel_specs(variant, dtypes), call_arguments(args, variant)):
        views = [None if d is None else bufs.at(p, d) for p, d in zip(ptrs, spec.pointer_dtypes)]
        spec.kernel[grid](*views, *ints, **dict(spec.constexprs))
    out = {
        "grad": grad[:, :vocab].float().numpy().copy(),
        "plan": np.array([variant.block, variant.chunk_blocks, variant.n_chunks, int(variant.aligned)]),
    }
    if pad:  # the padding columns are never written
        assert torch.isnan(grad[:, vocab:].float()).all(), "the backward wrote past the vocabulary"
    if grad_t is not None:
        out["grad_t"] = grad_t.numpy().copy()
    return out


def _child(in_path: str, out_path: str) -> None:
    meta = json.loads(open(in_path + ".json").read())
    arrays = np.load(in_path + ".npz")
    results = {}
    for i, case in enumerate(meta):
        a = {name: arrays[f"{name}{i}"] for name in case["arrays"]}
        for k, v in run_case(a, case).items():
            results[f"{k}{i}"] = v
    np.savez(out_path, **results)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
