"""token_logprob_rank's ``out_entropy``: the numpy backend and the interpreted kernels against the
float64 reference of ``helpers/entropy_cases.py`` (its tolerance derived there), on NaN-poisoned
outputs; the same bits at batch 1, 3, 100 and 513, with top-k, argmax, greedy rows and more chunks
per program; logprobs and ranks unchanged by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.entropy_cases import ENTROPY_ROWS, assert_entropy, entropy_case, entropy_ref  # noqa: E402
from helpers.logprob_cases import (  # noqa: E402
    POISON_LOGPROB,
    POISON_RANK,
    TORCH_DTYPES,
    assert_matches_reference,
    huge_case,
    round_to,
)
from helpers.logprob_interpreter import run_cases_by_name  # noqa: E402

from trace_replay_core import greedy_argmax_reference, softmax_entropy_reference, token_logprob_rank  # noqa: E402
from trace_replay_core.kernels.logprob_rank import LogprobRankDtypes, kernel_specs, plan_logprob_rank  # noqa: E402


def _cpu(x, ids, dtype, **kw):
    """The numpy backend into poisoned outputs (entropy NaN-filled): ``(logprobs, ranks, entropy)``."""
    logits = torch.from_numpy(x).to(TORCH_DTYPES[dtype])
    n = len(ids)
    lp, rk, ent = (
        np.full(n, POISON_LOGPROB, np.float32),
        np.full(n, POISON_RANK, np.int64),
        np.full(n, np.nan, np.float32),
    )
    token_logprob_rank(logits, ids, out_logprobs=lp, out_ranks=rk, out_entropy=ent, stream=0, **kw)
    return lp, rk, ent


def _bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("vocab", [1000, 999])
@pytest.mark.parametrize("with_temp", [False, True])
def test_cpu_backend_entropy_matches_reference(dtype, vocab, with_temp):
    rng = np.random.default_rng(vocab + 7 * with_temp)
    x, ids = entropy_case(rng, 23, vocab, dtype)
    temp = rng.uniform(0.3, 2.0, 23).astype(np.float32) if with_temp else None
    lp, rk, ent = _cpu(x, ids, dtype, temperature=temp)
    y = x if temp is None else x / temp[:, None]
    assert_entropy(y, ent, f"cpu {dtype} v{vocab} T={with_temp}", planted=not with_temp)
    assert_matches_reference(y, ids, lp, rk, f"cpu {dtype} v{vocab}")
    # the logprob and rank bits of a call without out_entropy
    lp0, rk0 = np.empty_like(lp), np.empty_like(rk)
    token_logprob_rank(
        torch.from_numpy(x).to(TORCH_DTYPES[dtype]), ids, out_logprobs=lp0, out_ranks=rk0, stream=0, temperature=temp
    )
    assert _bits(lp0) == _bits(lp) and _bits(rk0) == _bits(rk)


def test_cpu_backend_entropy_with_top_k_and_argmax():
    rng = np.random.default_rng(3)
    x, ids = entropy_case(rng, 17, 500, "bfloat16")
    ids[1::2] = -1  # greedy rows
    temp = rng.uniform(0.5, 2.0, 17).astype(np.float32)
    top_lp, top_ids = np.empty((17, 5), np.float32), np.empty((17, 5), np.int64)
    am = np.full(17, -777, np.int64)
    kw = dict(temperature=temp, top_k=5, out_topk_logprobs=top_lp, out_topk_ids=top_ids, out_argmax=am)
    lp, rk, ent = _cpu(x, ids, "bfloat16", **kw)
    y = x / temp[:, None]
    assert_entropy(y, ent, "cpu top-k argmax")
    want = greedy_argmax_reference(y)
    assert am.tolist() == want.tolist()
    assert_matches_reference(y, np.where(ids < 0, want, ids), lp, rk, "cpu top-k argmax")
    _, _, plain = _cpu(x, ids, "bfloat16", temperature=temp)
    assert _bits(plain) == _bits(ent)  # the entropy does not depend on the other outputs


def test_cpu_backend_hand_computed():
    x = np.full((6, 4), -np.inf, np.float32)
    x[0] = 2.0  # uniform: log 4
    x[1, :3] = np.log([0.5, 0.25, 0.25])  # 1.5 log 2
    x[2, 1] = 3.0  # one finite entry: 0
    x[3, [0, 2]] = 1.0  # two equal entries: log 2
    # row 4: only -inf; row 5: a NaN
    x[5] = [1.0, np.nan, 0.0, 2.0]
    _, _, ent = _cpu(x, np.zeros(6, np.int64), "float32")
    want = [np.log(4.0), 1.5 * np.log(2.0), 0.0, np.log(2.0)]
    np.testing.assert_allclose(ent[:4], want, rtol=1e-6, atol=1e-7)
    assert ent[2] == 0.0 and np.isnan(ent[4:]).all()
    np.testing.assert_allclose(softmax_entropy_reference(x)[:4], want, rtol=1e-7)  # x[1] rounded to float32
    assert np.isnan(softmax_entropy_reference(x)[4:]).all()


def test_public_reference_agrees_with_the_tests_reference():
    x, _ = entropy_case(np.random.default_rng(4), 30, 700, "float32")
    a, b = softmax_entropy_reference(x), entropy_ref(x)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], rtol=1e-12, atol=1e-14)


def test_numpy_backend_rows_alone_and_in_any_batch():
    x, ids = entropy_case(np.random.default_rng(5), 40, 300, "bfloat16")
    _, _, whole = _cpu(x, ids, "bfloat16")
    for rows in ([7], [39, 0, 12], list(range(40))[::-1]):
        _, _, part = _cpu(x[rows], ids[rows], "bfloat16")
        assert _bits(part) == _bits(whole[rows]), rows


def test_plan_and_kernels_with_entropy():
    """Entropy is part of the variant; without it the two entropy pointers are constexpr None and
    the kernels' ENTROPY constexpr is False (their code that of the kernels before entropy)."""
    dtypes = LogprobRankDtypes("bfloat16", "int64", "int64")
    for sm90 in (False, True):
        off = plan_logprob_rank(64, 151936, "bfloat16", sm90=sm90)
        on = plan_logprob_rank(64, 151936, "bfloat16", entropy=True, sm90=sm90)
        assert not off.entropy and on.entropy
        assert (on.block, on.chunk_blocks, on.n_chunks, on.cluster) == (
            off.block,
            off.chunk_blocks,
            off.n_chunks,
            off.cluster,
        )
        for spec_off, spec_on in zip(kernel_specs(off, dtypes), kernel_specs(on, dtypes), strict=True):
            assert dict(spec_off.constexprs)["ENTROPY"] is False and dict(spec_on.constexprs)["ENTROPY"] is True
            assert spec_off.pointer_dtypes[-2:] == (None, None)
            assert spec_on.pointer_dtypes[-2:] == ("float32", "float32")
            assert spec_off.pointer_dtypes[:-2] == spec_on.pointer_dtypes[:-2]


# -- the Triton kernels, in Triton's interpreter ---------------------------------------------
#
# One child process runs every case (helpers/logprob_interpreter.py): poisoned buffers (the
# entropy output NaN-filled), exactly the launches of the call's plan. The smallest cases that
# reach each branch: blocks of 128 logits, 9 rows (the planted rows of entropy_case).

INVARIANCE_BATCHES = (513, 100, 3, 1)
INVARIANCE_VOCAB = 96  # 192-byte rows: aligned bfloat16, the fused path; one partial block


def _invariance_rows():
    """The rows of each batch: 513 rows; 100 of them at other positions; 3 (the uniform, one-hot
    and near-one-hot rows, reordered); 1 (a plain row)."""
    return {513: np.arange(513), 100: np.arange(412, 512)[::-1], 3: np.array([3, 1, 2]), 1: np.array([300])}


def _interpreter_cases():
    rng = np.random.default_rng(31)
    cases = []

    def add(name, batch, vocab, dtype, data=None, **options):
        x, ids = data if data is not None else entropy_case(rng, batch, vocab, dtype)
        cases.append(dict(name=name, x=x, ids=ids, dtype=dtype, entropy=True, **options))

    # Chunks of 3 blocks of 128 (a line's maximum grows from block to block: u moved to it; the
    # fused path's two blocks loaded ahead, then its loop), the last chunk ending in a partial block.
    c3 = dict(block=128, chunk_blocks=3)
    add("f32-elem", 9, 1000, "float32", **c3)  # the element path, aligned rows
    add("f32-elem-temp", 9, 1000, "float32", **c3, temp=rng.uniform(0.3, 2.0, 9).astype(np.float32))
    add("bf16-fused", 9, 1000, "bfloat16", **c3)  # the fused path, aligned rows
    add("bf16-fused-shift", 9, 1001, "bfloat16", **c3)  # the fused path, rows not 16-byte aligned
    add("f16-elem-shift", 9, 999, "float16", **c3, pad=3, shift=1)  # the element path, shifted
    add("bf16-temp", 9, 1000, "bfloat16", **c3, temp=rng.uniform(0.3, 2.0, 9).astype(np.float32))
    add("bf16-real-block-shift", 2, 4100, "bfloat16")  # blocks of 2,048: 3 chunks, the last partial
    # top-k, argmax and greedy rows (id -1) at once: the fused path, and the element path's greedy loop
    same = entropy_case(rng, 9, 1000, "bfloat16")
    greedy = (same[0], np.where(np.arange(9) % 2 == 1, -1, same[1]))
    add("bf16-topk-argmax", 9, 1000, "bfloat16", data=greedy, **c3, top_k=5, argmax=True)
    add("bf16-plain-same-rows", 9, 1000, "bfloat16", data=same, **c3)
    same_t = entropy_case(rng, 9, 1000, "float32")
    temp = rng.uniform(0.3, 2.0, 9).astype(np.float32)
    greedy_t = (same_t[0], np.where(np.arange(9) % 2 == 1, -1, same_t[1]))
    add("f32-topk-argmax-temp", 9, 1000, "float32", data=greedy_t, **c3, top_k=5, argmax=True, temp=temp)
    add("f32-plain-temp-same-rows", 9, 1000, "float32", data=same_t, **c3, temp=temp)
    # Logits beyond 2**20 (bfloat16 without a temperature: flagged chunks re-summed in the merge).
    x, ids = huge_case(1000)
    add("huge-bf16", 9, 1000, "bfloat16", data=(round_to(x, "bfloat16"), ids), **c3)
    add("huge-f32", 9, 1000, "float32", data=(x, ids), **c3)
    # One chunk per program and three (4 chunks of 2 blocks: 3 and 1), both paths.
    for dtype, vocab in (("bfloat16", 1000), ("float32", 1000)):
        data = entropy_case(rng, 3, vocab, dtype)
        for group in (1, 3):
            add(f"{dtype}-g{group}", 3, vocab, dtype, data=data, block=128, chunk_blocks=2, group=group)
    # The same rows in batches of 513, 100, 3 and 1.
    x, ids = entropy_case(rng, 513, INVARIANCE_VOCAB, "bfloat16")
    for batch, rows in _invariance_rows().items():
        add(f"invariance-b{batch}", batch, INVARIANCE_VOCAB, "bfloat16", data=(x[rows], ids[rows]))
    # Without entropy: the logprob and rank bits of the bfloat16 case above.
    cases.append(dict(name="bf16-no-entropy", x=same[0], ids=same[1], dtype="bfloat16", **c3))
    return cases


def _processed(case):
    return case["x"] if case.get("temp") is None else case["x"] / case["temp"][:, None]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_cases_by_name(_interpreter_cases(), str(tmp_path_factory.mktemp("interp_entropy")))


REFERENCE_CASES = [c["name"] for c in _interpreter_cases() if c.get("entropy") and "invariance" not in c["name"]]


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_kernel_entropy_in_interpreter(interpreted, name):
    case, out = interpreted[name]
    y = _processed(case)
    planted = not name.startswith("huge") and case["x"].shape[0] >= 9 and case.get("temp") is None
    assert_entropy(y, out["ent"], f"interpreter {name}", planted=planted)
    ids = case["ids"]
    if case.get("argmax"):
        ids = np.where(ids < 0, greedy_argmax_reference(y), ids)
    assert_matches_reference(y, ids, out["lp"], out["rk"], f"interpreter {name}")


def test_kernel_entropy_does_not_depend_on_the_other_outputs(interpreted):
    """The same rows with top-k, argmax and greedy rows (the element path's own greedy block loop
    among them) and without: the same entropy bits; and logprobs and ranks have the bits of a
    call without entropy."""
    for with_all, plain in (
        ("bf16-topk-argmax", "bf16-plain-same-rows"),
        ("f32-topk-argmax-temp", "f32-plain-temp-same-rows"),
    ):
        assert _bits(interpreted[with_all][1]["ent"]) == _bits(interpreted[plain][1]["ent"]), with_all
    with_ent, without = interpreted["bf16-plain-same-rows"][1], interpreted["bf16-no-entropy"][1]
    assert "ent" not in without
    assert _bits(with_ent["lp"]) == _bits(without["lp"]) and _bits(with_ent["rk"]) == _bits(without["rk"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_group_changes_no_bit_of_entropy(interpreted, dtype):
    one, three = interpreted[f"{dtype}-g1"][1], interpreted[f"{dtype}-g3"][1]
    for key in ("ent", "lp", "rk"):
        assert _bits(one[key]) == _bits(three[key]), key


def test_kernel_entropy_is_batch_invariant(interpreted):
    """Each row's entropy (and logprob and rank) has the same bits in batches of 513, 100, 3 and 1,
    at other positions; the batch of 513 matches the reference, its planted rows included."""
    case, whole = interpreted["invariance-b513"]
    assert_entropy(case["x"], whole["ent"], "interpreter batch 513", planted=True)
    assert all(r < 513 for r in ENTROPY_ROWS.values())
    for batch, rows in _invariance_rows().items():
        _, out = interpreted[f"invariance-b{batch}"]
        for key in ("ent", "lp", "rk"):
            assert _bits(out[key]) == _bits(whole[key][rows]), f"batch {batch} {key}"
