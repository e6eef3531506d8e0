"""Which code do the logprob kernels compile to, configuration by configuration?

Question: does a change to the logprob op's source change the code of the kernels its plan
chooses? Each configuration of the bench's shapes (bench/logprob_rank.py: vocabulary 151,936
contiguous and in rows of 151,937, GPT-2's 50,257, and the other vocabularies of the tuning
harness; bfloat16, float32, float16; top-k 0 and 20; with and without an argmax output and a
temperature) is planned as a call of ``BATCH`` rows would be, and each kernel of the plan is
compiled for sm_90 with this machine's Triton (no GPU needed); the sha256 of its PTX (line
information off, so that only the code counts) is recorded per configuration. Without top-k the
chunk kernel is also compiled in its cluster form (the form a call takes on sm_90 when its rows
fit on the device at once; the batch and the device decide, so both are listed). The batch does
not change the compiled code (chunks per program are a runtime value).

The same script reads code from before the op had a single plan (``launch_specs`` and module
constants, ``--legacy``), so that one run per source tree gives two comparable lists.

Run: ``python bench/tuning/ptx_hashes.py --label after --out bench/results/logprob_ptx_hashes.json``
with ``PYTHONPATH`` naming the source tree to read (``--legacy`` for a tree before the plan);
entries of other labels already in the file are kept.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import source_commit  # noqa: E402

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # before Triton reads its settings

BATCH = 256
PTR_TYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int32": "*i32", "int64": "*i64"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES = ("bfloat16", "float32", "float16")
# (vocabulary, row stride): the bench's contiguous and unaligned rows, GPT-2, the tuning vocabularies
LAYOUTS = (
    (151_936, 151_936),
    (151_936, 151_937),
    (50_257, 50_257),
    (32_000, 32_000),
    (128_256, 128_256),
    (10_001, 10_001),
)


def configurations():
    """Every configuration as a dict; all flags on the bench's main vocabulary, the plain call and
    top-k on the others (their kernels differ from 151,936's in the plan's sizes only)."""
    out = []
    for vocab, stride in LAYOUTS:
        main = (vocab, stride) == (151_936, 151_936)
        for dtype in DTYPES:
            for top_k in (0, 20):
                for argmax in (False, True) if main or vocab == 50_257 else (False,):
                    for temp in (False, True) if main else (False,):
                        out.append(dict(vocab=vocab, stride=stride, dtype=dtype, top_k=top_k, argmax=argmax, temp=temp))
    return out


def config_name(c) -> str:
    return (
        f"v{c['vocab']}_s{c['stride']}_{c['dtype']}_k{c['top_k']}"
        f"{'_argmax' if c['argmax'] else ''}{'_temp' if c['temp'] else ''}"
    )


def _args(module, c):
    """The integer arguments of a call of ``BATCH`` rows of this configuration (fake addresses,
    16-byte aligned: the alignment of the rows comes from the stride)."""
    return module.LogprobRankArgs(
        1 << 20,
        2 << 20,
        (3 << 20) if c["temp"] else 0,
        4 << 20,
        5 << 20,
        (6 << 20) if c["top_k"] else 0,
        (7 << 20) if c["top_k"] else 0,
        8 << 20,
        BATCH,
        c["vocab"],
        c["stride"],
        c["top_k"],
        (9 << 20) if c["argmax"] else 0,
    )


def _dtypes(module, c):
    return module.LogprobRankDtypes(c["dtype"], "int64", "int64", "int64", "int64")


def legacy_specs(c):
    """``[(label, kernel, pointer dtypes, n ints, constexprs, num_warps, maxnreg)]`` from the code
    before the single plan: ``launch_specs`` with the module's constants, as its launch on sm_90
    compiled them (GDC on, the chunk kernel's register cap)."""
    from trace_replay_core.kernels import logprob_rank as lr

    args, dtypes = _args(lr, c), _dtypes(lr, c)
    plan = lr.plan_logprob_rank(c["vocab"], ITEMSIZE[c["dtype"]], c["top_k"])
    specs = []
    forms = [False]
    if lr.LOGPROB_CLUSTER and not plan.k_pad and plan.n_chunks <= lr.LOGPROB_CLUSTER_MAX:
        forms.append(True)
    for cluster in forms:
        for i, (kernel, _, _, ptr_dtypes, ints, const, warps) in enumerate(
            lr.launch_specs(args, dtypes, plan, None, cluster)
        ):
            if cluster and i == 0:
                label = "chunk_cluster"
            elif cluster:
                continue
            else:
                label = ("chunk", "combine")[i]
            maxnreg = plan.maxnreg if i == 0 and plan.maxnreg else None
            specs.append((label, kernel, tuple(ptr_dtypes), len(ints), dict(const, GDC=lr.LOGPROB_PDL), warps, maxnreg))
    return specs


def current_specs(c):
    """The same list from the plan: :func:`plan_logprob_rank` for sm_90, its kernels' specs."""
    from trace_replay_core.kernels import logprob_rank as lr

    args, dtypes = _args(lr, c), _dtypes(lr, c)
    specs = []
    for cluster in (False, True):
        variant = lr.plan_for_call(args, dtypes, sm90=True, cluster=cluster)
        if cluster and not variant.cluster:
            continue
        for i, spec in enumerate(lr.kernel_specs(variant, dtypes)):
            label = "chunk_cluster" if cluster else ("chunk", "combine")[i]
            specs.append(
                (
                    label,
                    spec.kernel,
                    spec.pointer_dtypes,
                    spec.n_ints,
                    dict(spec.constexprs),
                    spec.num_warps,
                    spec.maxnreg,
                )
            )
    return specs


def ptx_sha256(kernel, ptr_dtypes, n_ints, constexprs, num_warps, maxnreg) -> str:
    """The sha256 of the kernel's PTX for sm_90 (Triton of this process, no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    # a pointer of dtype None is compiled as a constexpr None, as _compiled.compiled does
    signature = dict(zip(names, ["constexpr" if d is None else PTR_TYPES[d] for d in ptr_dtypes] + ["i32"] * n_ints))
    fixed = {(i,): None for i, d in enumerate(ptr_dtypes) if d is None}
    for name in names[len(ptr_dtypes) + n_ints :]:
        signature[name] = "constexpr"
        fixed[(names.index(name),)] = constexprs[name]
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(ASTSource(kernel, signature, fixed), target=GPUTarget("cuda", 90, 32), options=options)
    lines = [ln for ln in compiled.asm["ptx"].splitlines() if not ln.lstrip().startswith((".loc", ".file", "//"))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _hash_job(job):
    legacy, name, label = job
    c = next(c for c in configurations() if config_name(c) == name)
    spec = next(s for s in (legacy_specs(c) if legacy else current_specs(c)) if s[0] == label)
    return name, label, ptx_sha256(*spec[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="the list's name in the results file (before, after)")
    p.add_argument("--out", required=True)
    p.add_argument("--legacy", action="store_true", help="read code from before the single plan")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    import triton

    specs = legacy_specs if a.legacy else current_specs
    # one compile per distinct kernel: configurations that share a kernel share its hash
    jobs: list[tuple[bool, str, str]] = []
    seen: dict[tuple, tuple[str, str]] = {}
    same_as: dict[tuple[str, str], tuple[str, str]] = {}
    for c in configurations():
        for label, kernel, ptrs, n_ints, const, warps, maxnreg in specs(c):
            key = (kernel.__name__, ptrs, n_ints, tuple(sorted(const.items())), warps, maxnreg)
            if key in seen:
                same_as[(config_name(c), label)] = seen[key]
            else:
                seen[key] = (config_name(c), label)
                jobs.append((a.legacy, config_name(c), label))
    print(f"{len(same_as) + len(jobs)} kernels, {len(jobs)} distinct; compiling", flush=True)
    hashes: dict[str, dict[str, str]] = {}
    with ProcessPoolExecutor(a.jobs) as pool:
        for name, label, sha in pool.map(_hash_job, jobs):
            hashes.setdefault(name, {})[label] = sha
            print(f"{name} {label} {sha[:16]}", flush=True)
    for (name, label), (src_name, src_label) in same_as.items():
        hashes.setdefault(name, {})[label] = hashes[src_name][src_label]
    # the commit of the tree whose code was read (TRACE_REPLAY_COMMIT, when set, names it)
    import trace_replay_core

    commit, dirty = source_commit(os.path.dirname(os.path.dirname(os.path.abspath(trace_replay_core.__file__))))
    results = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            results = json.load(f)
    results[a.label] = {
        "provenance": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "triton": triton.__version__,
            "target": "cuda sm_90, warp size 32, line info off",
            "command": " ".join(["python", "bench/tuning/ptx_hashes.py"] + sys.argv[1:]),
            "commit": commit,
            "dirty": dirty,
            "batch": BATCH,
        },
        "kernels": {name: dict(sorted(hashes[name].items())) for name in sorted(hashes)},
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {a.out}: {len(hashes)} configurations")


if __name__ == "__main__":
    main()
