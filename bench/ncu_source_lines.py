"""Where does the logprob chunk kernel's time go, line by line?

Question: which source lines of the chunk kernel (bfloat16, vocabulary 151,936, batch 256,
plain and with top-k 20) hold the warps' stall samples, and in which phase of a program
(start, block loop, chunk reductions, top-k selection)?

Method: ``scripts/gpu_tier.sh profile-logprob-source`` records Nsight Compute's warp-state
samples per SASS instruction on the GPU (``ncu_src_k0.csv.gz``, ``ncu_src_k20.csv.gz``). This
script, run on any machine with the same Triton version as the GPU machine (the SASS must be the
same), compiles the same kernel for sm_90 without a GPU, checks that every sampled instruction
matches the local SASS, and joins the samples to the source lines of the cubin's line table
(``nvdisasm -g``). Lines of Triton's own library (reductions, scans, sorts) are reported as they
are, and per 2 KiB of code, which follows the program's phases.

Run: ``python bench/ncu_source_lines.py TOP_K ncu_src_kTOP_K.csv.gz`` (TOP_K 0 or 20); prints the
table (commit it as ``bench/results/ncu_logprob_source_b256_k<TOP_K>.txt``).
"""

from __future__ import annotations

import collections
import csv
import gzip
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VOCAB, BATCH = 151_936, 256
PTR_TYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int32": "*i32", "int64": "*i64"}


def compiled_chunk_kernel(top_k: int):
    """The chunk kernel as bench/ncu launches it (bf16, aligned rows, sm_90 with GDC), compiled
    here for sm_90: ``(cubin bytes, triton version)``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trace_replay_core.kernels.logprob_rank import (
        LogprobRankArgs,
        LogprobRankDtypes,
        kernel_specs,
        plan_for_call,
    )

    k = top_k
    args = LogprobRankArgs(
        1 << 20, 2 << 20, 0, 4 << 20, 5 << 20, (6 << 20) * (k > 0), (7 << 20) * (k > 0), 8 << 20, BATCH, VOCAB, VOCAB, k
    )
    dtypes = LogprobRankDtypes("bfloat16", "int64", "int64", "int64", "int64")
    variant = plan_for_call(args, dtypes, sm90=True, cluster=False)  # batch 256: the two kernels
    spec = kernel_specs(variant, dtypes)[0]
    kernel, ptr_dtypes, constexprs, num_warps = spec.kernel, spec.pointer_dtypes, dict(spec.constexprs), spec.num_warps
    ints = range(spec.n_ints)
    names = kernel.arg_names
    # a pointer of dtype None is compiled as a constexpr None, as _compiled.compiled does
    signature = dict(zip(names, ["constexpr" if d is None else PTR_TYPES[d] for d in ptr_dtypes] + ["i32"] * len(ints)))
    fixed: dict = {(i,): None for i, d in enumerate(ptr_dtypes) if d is None}
    for name in names[len(ptr_dtypes) + len(ints) :]:
        signature[name] = "constexpr"
        fixed[(names.index(name),)] = constexprs[name]
    options = {"num_warps": num_warps, **({"maxnreg": spec.maxnreg} if spec.maxnreg else {})}
    compiled = triton.compile(ASTSource(kernel, signature, fixed), target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["cubin"], triton.__version__


def line_table(cubin: bytes):
    """``{sass offset: (file:line, instruction)}`` from ``nvdisasm -g`` (Triton's bundled one)."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-g", "-c", f.name], capture_output=True, text=True, check=True).stdout
    where, table = "?", {}
    for line in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            table[int(m.group(1), 16)] = (where, m.group(2))
    return table


def main() -> None:
    top_k, path = int(sys.argv[1]), sys.argv[2]
    cubin, version = compiled_chunk_kernel(top_k)
    table = line_table(cubin)
    rows = list(csv.reader(gzip.open(path, "rt")))
    header, data = rows[1], rows[2:]
    i_addr, i_src = header.index("Address"), header.index("Source")
    i_all = header.index("Warp Stall Sampling (All Samples)")
    stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][i_addr], 16)
    per_line: collections.Counter[str] = collections.Counter()
    reasons: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    per_block: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = mismatched = 0
    for row in data:
        offset = int(row[i_addr], 16) - base
        where, local = table.get(offset, ("?", ""))
        tokens = row[i_src].split()
        if tokens and tokens[0].startswith("@"):  # a predicate
            tokens = tokens[1:]
        if tokens and tokens[0].split(".")[0] not in local:
            mismatched += 1
        n = int(row[i_all] or 0)
        total += n
        per_line[where] += n
        per_block[offset // 0x800][where] += n
        for i in stall_cols:
            if int(row[i] or 0):
                reasons[where][header[i][len("stall_") :]] += int(row[i])
    print(
        f"chunk kernel, bf16, vocabulary {VOCAB}, batch {BATCH}, top_k {top_k}: {total} warp samples; "
        f"{len(data)} sampled instructions, {mismatched} not matching the SASS compiled here (Triton {version})"
    )
    print("\nsamples  share  line  (top stall reasons)")
    for where, n in per_line.most_common(30):
        top = ", ".join(f"{k} {v}" for k, v in reasons[where].most_common(3))
        print(f"{n:7d} {100 * n / total:5.1f}%  {where}  ({top})")
    print("\nper 2 KiB of code (program order): offset, samples, top lines")
    for block in sorted(per_block):
        n = sum(per_block[block].values())
        if n >= total // 100:
            top = ", ".join(f"{k} {v}" for k, v in per_block[block].most_common(4))
            print(f"{block * 0x800:#07x} {n:6d}  {top}")


if __name__ == "__main__":
    main()
