"""token_logprob_rank's Triton kernels in Triton's interpreter, on the CPU: the launches the GPU
path makes, on poisoned buffers, against the float64 reference with the tolerance of
``test_logprob_rank.py`` (its data and checks)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.logprob_cases import (  # noqa: E402
    TORCH_DTYPES,
    assert_matches_reference,
    assert_planted,
    assert_special,
    huge_case,
    make_case,
    round_to,
    special_case,
)
from helpers.logprob_interpreter import run_cases_by_name  # noqa: E402

from trace_replay_core.kernels.logprob_rank import plan_logprob_rank  # noqa: E402

# -- the Triton kernels, in Triton's interpreter ---------------------------------------------
#
# The kernels run in a child process with TRITON_INTERPRET=1 (helpers/logprob_interpreter.py):
# poisoned torch CPU buffers, exactly the launches of the call's plan. Each case is the smallest
# that reaches its branch: blocks of 128 logits unless the case is about the real block.

GROUP_DATA = make_case(np.random.default_rng(12), 3, 1000, "bfloat16")
LAYOUT_DATA = make_case(np.random.default_rng(14), 3, 1000, "bfloat16")
# The same bfloat16 rows laid out with 16-byte aligned rows and three ways without: rows of 1,001
# (each row's start 2 bytes further off), the array 6 bytes off (every row alike), rows of 1,005
# with the array 10 bytes off. Options of the interpreter driver (helpers/logprob_interpreter.py).
LAYOUTS = {"aligned": {}, "stride1001": {"pad": 1}, "skew6": {"shift": 3}, "stride1005-skew10": {"pad": 5, "shift": 5}}
LAYOUT_CALLS = {"plain": {}, "top5": {"top_k": 5}, "argmax": {"argmax": True}}
LAYOUT_DTYPES: tuple[tuple[str, str, dict], ...] = (
    ("bf16", "bfloat16", {}),
    ("f32", "float32", {}),
    ("f16", "float16", {}),
    ("bf16temp", "bfloat16", {"temp": np.linspace(0.5, 2.0, 3).astype(np.float32)}),
)


def _interpreter_cases():
    """Cases: name, x float32 (exact in dtype), ids, and the driver's options."""
    rng = np.random.default_rng(11)
    cases = []

    def add(name, batch, vocab, dtype, *, data=None, special=None, **options):
        x, ids = data if data is not None else make_case(rng, batch, vocab, dtype)
        special = data is not None if special is None else special
        cases.append(dict(name=name, x=round_to(x, dtype), ids=ids, dtype=dtype, special=special, **options))

    # The real block (2048, four warps): vocab 32,000 is 8 chunks of 2 blocks, the last one partial.
    add("f32-2x32000", 2, 32000, "float32")
    add("bf16-2x32000-rows-padded", 2, 32000, "bfloat16", pad=8, ids_dtype="int32", rank_dtype="int32")
    add("f16-3x1000-unaligned", 3, 1000, "float16", pad=3, shift=1)
    add("bf16-1x1", 1, 1, "bfloat16")
    add("bf16-2x8193", 2, 8193, "bfloat16")  # a last block of one logit, rows not aligned
    # Blocks of 128: several chunks, partial last blocks, the combine's loop on small rows.
    add("f32-4x1000-t128", 4, 1000, "float32", block=128)
    add("bf16-3x1000-t128-padded", 3, 1000, "bfloat16", block=128, pad=5)
    add("f16-3x999-t128", 3, 999, "float16", block=128, rank_dtype="int32")
    # Chunks of several blocks and of one, a last chunk that is only a partial block.
    add("f32-2x2000-t128-c5", 2, 2000, "float32", block=128, chunk_blocks=5)
    add("f16-2x200-t128-c1", 2, 200, "float16", block=128, chunk_blocks=1, pad=3, shift=1)
    # Several chunks per program (3: a row's 8 chunks as 3, 3 and 2), against the same rows with
    # one chunk per program: the bits must be the same (test_group_changes_no_bit).
    for name, extra in (("bf16-3x1000-t128", {}), ("bf16-3x1000-t128-g3", {"group": 3})):
        add(name, 3, 1000, "bfloat16", block=128, data=GROUP_DATA, special=False, **extra)
    # Rows in every layout: unaligned ones read each line's two aligned vectors and shift its
    # words into place (test_layouts_same_bits), on the fused bfloat16 path and on the element
    # path (float32, float16, bfloat16 with a temperature). Chunks of 3 blocks of 128 (the fused
    # path's two blocks loaded ahead, then its loop), the last chunk ending in a partial block.
    for prefix, dtype, extra in LAYOUT_DTYPES:
        for layout, where in LAYOUTS.items():
            for call, options in LAYOUT_CALLS.items():
                name = f"{prefix}-3x1000-t128-{layout}-{call}"
                data = dict(block=128, chunk_blocks=3, data=LAYOUT_DATA, special=False)
                add(name, 3, 1000, dtype, **data, **where, **options, **extra)
    # Aligned bfloat16 rows (vocab 304: 608-byte rows) take the fused path; the same special rows
    # and logits beyond 2**20 (flagged chunks, re-summed by the combine kernel).
    for block in (None, 128):
        x, ids, _ = special_case(304)
        add(f"special-bf16-aligned-t{block}", 10, 304, "bfloat16", block=block, data=(x, ids))
        add(f"huge-bf16-t{block}", 9, 1000, "bfloat16", block=block, data=huge_case(1000), special=False, planted=False)
    add("huge-f32-t128", 9, 1000, "float32", block=128, data=huge_case(1000), special=False, planted=False)
    for dtype in TORCH_DTYPES:
        for block in (None, 128):
            x, ids, _ = special_case()
            add(f"special-{dtype}-t{block}", 10, 300, dtype, block=block, data=(x, ids))
        x, ids, _ = special_case()
        add(f"special-{dtype}-t128-c1-g2", 10, 300, dtype, block=128, chunk_blocks=1, group=2, data=(x, ids))
    return cases


def _processed(case):
    """The case's logits as the kernels reduce them: ``x / T`` in float32 where it has a temperature."""
    return case["x"] if case.get("temp") is None else case["x"].astype(np.float32) / case["temp"][:, None]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_cases_by_name(_interpreter_cases(), str(tmp_path_factory.mktemp("interp")))


@pytest.mark.parametrize("name", [c["name"] for c in _interpreter_cases()])
def test_kernel_in_interpreter(interpreted, name):
    case, out = interpreted[name]
    lp, rk = out["lp"], out["rk"]
    batch, vocab = case["x"].shape
    block, chunk_blocks, n_chunks, k_pad = out["plan"].tolist()
    plan = plan_logprob_rank(
        batch,
        vocab,
        case["dtype"],
        case.get("top_k", 0),
        block=case.get("block"),
        chunk_blocks=case.get("chunk_blocks"),
    )
    assert (block, chunk_blocks, n_chunks, k_pad) == (plan.block, plan.chunk_blocks, plan.n_chunks, plan.k_pad)
    assert (n_chunks - 1) * chunk_blocks * block < vocab <= n_chunks * chunk_blocks * block  # chunks cover the row
    if case["special"]:
        _, _, expect = special_case(vocab)
        assert_special(case["x"], case["ids"], lp, rk, expect, f"interpreter {name}")
    else:
        y = _processed(case)
        assert_matches_reference(y, case["ids"], lp, rk, f"interpreter {name}")
        if case.get("planted", True):
            assert_planted(y, case["ids"], rk)


def test_group_changes_no_bit(interpreted):
    """Which program runs a chunk (one chunk per program, or three) changes no bit of the result."""
    _, one = interpreted["bf16-3x1000-t128"]
    _, other = interpreted["bf16-3x1000-t128-g3"]
    assert np.array_equal(one["lp"].view(np.uint32), other["lp"].view(np.uint32))
    assert np.array_equal(one["rk"], other["rk"])


@pytest.mark.parametrize("prefix", [p for p, _, _ in LAYOUT_DTYPES])
def test_layouts_same_bits(interpreted, prefix):
    """The same rows with 16-byte aligned rows and without (a padded stride, an array that starts
    off a 16-byte boundary, both), in every dtype, with and without a temperature: unaligned rows
    read each line's two aligned vectors and shift its words into place, so every layout gives
    the same bits, with top-k and argmax too, and never reads the NaN poison around the rows into
    a result."""
    for call in LAYOUT_CALLS:
        case, ref = interpreted[f"{prefix}-3x1000-t128-aligned-{call}"]
        if call == "plain":
            assert_matches_reference(_processed(case), case["ids"], ref["lp"], ref["rk"], f"interpreter {prefix}")
        for layout in LAYOUTS:
            _, out = interpreted[f"{prefix}-3x1000-t128-{layout}-{call}"]
            assert sorted(out) == sorted(ref)
            for key in ref:
                a, b = ref[key], out[key]
                a, b = (a.view(np.uint32), b.view(np.uint32)) if a.dtype == np.float32 else (a, b)
                assert np.array_equal(a, b), f"{prefix} {layout} {call} {key}"
