"""Run the logprob kernels' launches in Triton's interpreter, as the GPU path would make them.

The interpreter must be switched on before Triton is imported (``TRITON_INTERPRET=1``), and the
kernels call other ``@triton.jit`` helpers, so they run in a child process with that variable set
for the child only. :func:`run_cases` (parent) writes the cases, starts this module as the child
and reads the outputs back. The child (:func:`run_case`) lays every array out in its own poisoned
torch CPU buffer (the interpreter takes torch CPU tensors), builds the integer arguments
(:class:`LogprobRankArgs`), and launches exactly the kernels of the call's plan
(:func:`plan_for_call`, :func:`kernel_specs`, :func:`call_arguments`), each pointer handed over
as a typed view of the buffer that holds its address.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

CASE_KEYS = (
    "dtype",
    "top_k",
    "pad",
    "shift",
    "ids_dtype",
    "rank_dtype",
    "block",
    "num_warps",
    "chunk_blocks",
    "group",
    "argmax",
    "entropy",
)


def run_cases(cases: list[dict], tmp_dir: str) -> dict[str, dict]:
    """Parent side: ``cases`` have ``name``, ``x`` (float32, exact in ``dtype``), ``ids``, optional
    ``temp`` and any of :data:`CASE_KEYS`; returns ``{name: {"lp", "rk", ["tlp", "tid"], ["am"], ["ent"],
    "plan"}}`` (``am``: the greedy tokens, for a case with ``argmax`` true; ``ent``: the entropies,
    for a case with ``entropy`` true)."""
    in_path, out_path = os.path.join(tmp_dir, "cases"), os.path.join(tmp_dir, "out.npz")
    meta = [{k: c[k] for k in ("name",) + CASE_KEYS if k in c} | {"has_temp": c.get("temp") is not None} for c in cases]
    with open(in_path + ".json", "w") as f:
        json.dump(meta, f)
    arrays = {}
    for i, c in enumerate(cases):
        arrays[f"x{i}"], arrays[f"ids{i}"] = c["x"], c["ids"]
        if c.get("temp") is not None:
            arrays[f"t{i}"] = c["temp"]
    np.savez(in_path + ".npz", **arrays)
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    paths = [root, os.path.join(root, "adapters"), tests]
    env["PYTHONPATH"] = os.pathsep.join(paths + env.get("PYTHONPATH", "").split(os.pathsep))
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
    results = {}
    for i, c in enumerate(cases):
        r = {k: out[f"{k}{i}"] for k in ("lp", "rk", "tlp", "tid", "am", "ent", "plan") if f"{k}{i}" in out}
        results[c["name"]] = r
    return results


def run_cases_by_name(cases: list[dict], tmp_dir: str) -> dict[str, tuple]:
    """:func:`run_cases`, keyed by case name: ``{name: (case, outputs)}``."""
    out = run_cases(cases, tmp_dir)
    return {c["name"]: (c, out[c["name"]]) for c in cases}


def _torch_dtypes():
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int32": torch.int32,
        "int64": torch.int64,
    }


class _Buffers:
    """Poisoned uint8 buffers; :meth:`at` returns a typed view starting at an address."""

    def __init__(self):
        self.buffers = []

    def new(self, nbytes: int, *, shift_bytes: int = 0):
        import torch

        b = torch.full((nbytes + shift_bytes + 128,), 0xFF, dtype=torch.uint8)
        self.buffers.append(b)
        start = (-b.data_ptr()) % 64 + shift_bytes
        return b[start : start + nbytes]

    def at(self, address: int, dtype: str):
        td = _torch_dtypes()[dtype]
        size = td.itemsize
        for b in self.buffers:
            lo = b.data_ptr()
            if lo <= address < lo + b.numel():
                off = address - lo
                n = (b.numel() - off) // size
                return b[off : off + n * size].view(td)
        raise KeyError(f"no buffer holds address 0x{address:x}")


def run_case(x, ids, temp, case: dict) -> dict:
    """Child side: one call through the interpreter; returns the outputs as numpy arrays."""
    import torch

    from trace_replay_core.kernels.logprob_rank import (
        LogprobRankArgs,
        LogprobRankDtypes,
        call_arguments,
        kernel_specs,
        plan_for_call,
        workspace_layout,
    )

    td = _torch_dtypes()
    dtype, top_k = case["dtype"], case.get("top_k", 0)
    ids_dtype, rank_dtype = case.get("ids_dtype", "int64"), case.get("rank_dtype", "int64")
    pad, shift = case.get("pad", 0), case.get("shift", 0)
    batch, vocab = x.shape
    itemsize = td[dtype].itemsize
    stride = vocab + pad
    bufs = _Buffers()
    logits = bufs.new(batch * stride * itemsize, shift_bytes=shift * itemsize).view(td[dtype]).view(batch, stride)
    logits.fill_(float("nan"))  # padding would poison a misread
    logits[:, :vocab] = torch.from_numpy(x).to(td[dtype])
    ids_t = bufs.new(batch * td[ids_dtype].itemsize).view(td[ids_dtype])
    ids_t.copy_(torch.from_numpy(np.asarray(ids)).to(td[ids_dtype]))

    def out(n, dt):
        return bufs.new(max(n, 1) * td[dt].itemsize).view(td[dt])

    lp, rk = out(batch, "float32"), out(batch, rank_dtype)
    tlp, tid = out(batch * top_k, "float32"), out(batch * top_k, rank_dtype)
    am = out(batch, rank_dtype) if case.get("argmax") else None
    ent = out(batch, "float32") if case.get("entropy") else None
    t_buf = None
    if temp is not None:
        t_buf = out(batch, "float32")
        t_buf.copy_(torch.from_numpy(np.asarray(temp, dtype=np.float32)))
    dtypes = LogprobRankDtypes(dtype, ids_dtype, rank_dtype, rank_dtype, rank_dtype)
    args = LogprobRankArgs(
        logits.data_ptr(),
        ids_t.data_ptr(),
        t_buf.data_ptr() if t_buf is not None else 0,
        lp.data_ptr(),
        rk.data_ptr(),
        tlp.data_ptr() if top_k else 0,
        tid.data_ptr() if top_k else 0,
        0,
        batch,
        vocab,
        stride,
        top_k,
        am.data_ptr() if am is not None else 0,
        ent.data_ptr() if ent is not None else 0,
    )
    # The plan as the GPU path makes it, without inline PTX (the interpreter cannot run it: the
    # chunk kernel counts per logit instead of with packed compares, an exact integer either way);
    # block, warps, chunk_blocks and group as the case overrides them.
    overrides = {k: case[k] for k in ("block", "num_warps", "chunk_blocks", "group") if case.get(k) is not None}
    variant = plan_for_call(args, dtypes, inline_ptx=False, **overrides)
    ws = bufs.new(workspace_layout(batch, variant)[-1] + 16)
    args = args._replace(workspace=ws.data_ptr())
    for spec, (grid, ptrs, ints) in zip(kernel_specs(variant, dtypes), call_arguments(args, variant)):
        views = [None if d is None else bufs.at(p, d) for p, d in zip(ptrs, spec.pointer_dtypes)]
        spec.kernel[grid](*views, *ints, **dict(spec.constexprs))
    result = {
        "lp": lp[:batch].numpy().copy(),
        "rk": rk[:batch].numpy().astype(np.int64),
        "plan": np.array([variant.block, variant.chunk_blocks, variant.n_chunks, variant.k_pad]),
    }
    if am is not None:
        result["am"] = am[:batch].numpy().astype(np.int64)
    if ent is not None:
        result["ent"] = ent[:batch].numpy().copy()
    if top_k:
        result["tlp"] = tlp[: batch * top_k].numpy().reshape(batch, top_k).copy()
        result["tid"] = tid[: batch * top_k].numpy().reshape(batch, top_k).astype(np.int64)
    return result


def _child(in_path: str, out_path: str) -> None:
    meta = json.loads(open(in_path + ".json").read())
    arrays = np.load(in_path + ".npz")
    results = {}
    for i, case in enumerate(meta):
        temp = arrays[f"t{i}"] if case.get("has_temp") else None
        for k, v in run_case(arrays[f"x{i}"], arrays[f"ids{i}"], temp, case).items():
            results[f"{k}{i}"] = v
    np.savez(out_path, **results)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
