"""trace_replay_app.metrics: verl's, prime-rl's and slime's train/rollout mismatch measures.

The expected values are worked out by hand from each stack's formula (see the module's
docstring) on logprobs that are multiples of ``L = ln 2``, so that every ratio is a power of 2.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_replay_app.metrics import METRIC_KEYS, RLMetrics, rl_metrics

L = math.log(2)
V, P, S = "verl/rollout_corr/", "prime_rl/mismatch_kl/all/", "slime/train/"

# Three requests of 2, 3 and 1 tokens. Log ratios x = t - r: A [2L, 2L], B [-2L, -2L, 2L],
# C [3L]; ratios rho = exp(x): A [4, 4], B [1/4, 1/4, 4], C [8].
TRAIN = [[-L, -L], [-3 * L, -3 * L, -L], [-L]]
ROLLOUT = [[-3 * L, -3 * L], [-L, -L, -3 * L], [-4 * L]]
K3_UP, K3_DOWN, K3_C = 3 - 2 * L, 2 * L - 3 / 4, 7 - 3 * L  # exp(x) - x - 1 at 2L, -2L, 3L


def run(train=TRAIN, rollout=ROLLOUT, **options) -> RLMetrics:
    return rl_metrics(
        train=[np.array(t, dtype=np.float64) for t in train],
        rollout=[np.array(r, dtype=np.float64) for r in rollout],
        **options,
    )


def check(got: dict, expected: dict, rel: float = 1e-12) -> None:
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=0.0), key


def test_verl_diagnostics_by_hand():
    check(
        run().batch,
        {
            # per request -mean(t): L, 7L/3, L; -mean(r): 3L, 5L/3, 4L; both averaged over requests
            V + "training_log_ppl": 13 * L / 9,
            V + "training_ppl": (2 + 2 ** (7 / 3) + 2) / 3,
            V + "rollout_log_ppl": 26 * L / 9,
            V + "rollout_ppl": (8 + 2 ** (5 / 3) + 16) / 3,
            # d = mean(r) - mean(t) per request: -2L, 2L/3, -3L
            V + "log_ppl_diff": -13 * L / 9,
            V + "log_ppl_abs_diff": 17 * L / 9,
            V + "log_ppl_diff_max": 2 * L / 3,
            V + "log_ppl_diff_min": -3 * L,
            V + "ppl_ratio": (1 / 4 + 2 ** (2 / 3) + 1 / 8) / 3,
            # token means over the 6 tokens (the sequence mean of r - t would be -13L/9)
            V + "kl": -5 * L / 6,
            V + "k3_kl": (3 * K3_UP + 2 * K3_DOWN + K3_C) / 6,
            V + "chi2_token": (16 + 16 + 1 / 16 + 1 / 16 + 16 + 64) / 6 - 1,
            # (prod rho)^2 per request: 256, 1/16, 64
            V + "chi2_seq": (256 + 1 / 16 + 64) / 3 - 1,
        },
    )


def test_verl_token_is_statistics_by_hand():
    # w = [4, 4, 1/4, 1/4, 4, 8]; clipped to [1/2, 2]: [2, 2, 1/2, 1/2, 2, 2] (mean 3/2, mean square 11/4);
    # per-request means of w: 4, 3/2, 8
    seq = [4, 3 / 2, 8]
    check(
        run().batch,
        {
            V + "rollout_is_mean": 41 / 12,
            V + "rollout_is_max": 8,
            V + "rollout_is_min": 1 / 4,
            V + "rollout_is_ratio_fraction_high": 4 / 6,
            V + "rollout_is_ratio_fraction_low": 2 / 6,
            V + "rollout_is_std": math.sqrt(11 / 4 - 9 / 4),
            V + "rollout_is_eff_sample_size": (9 / 4) / (11 / 4),
            V + "rollout_is_seq_mean": 9 / 2,
            V + "rollout_is_seq_std": math.sqrt(sum((s - 9 / 2) ** 2 for s in seq) / 2),
            V + "rollout_is_seq_max": 8,
            V + "rollout_is_seq_min": 3 / 2,
            V + "rollout_is_seq_max_deviation": 7,
            V + "rollout_is_seq_fraction_high": 2 / 3,
            V + "rollout_is_seq_fraction_low": 0,
        },
    )


def test_verl_sequence_is_statistics_by_hand():
    # S = sum(x): 4L, -2L, 3L; W = exp(S): 16, 1/4, 8, carried by 2, 3 and 1 tokens;
    # clipped per token: [2, 2, 1/2, 1/2, 1/2, 2] (mean 5/4, mean square 17/8)
    seq = [16, 1 / 4, 8]
    check(
        run(rollout_is="sequence").batch,
        {
            V + "rollout_is_mean": (2 * 16 + 3 / 4 + 8) / 6,  # token-weighted, not rollout_is_seq_mean
            V + "rollout_is_max": 16,
            V + "rollout_is_min": 1 / 4,
            V + "rollout_is_ratio_fraction_high": 2 / 3,  # fractions of requests
            V + "rollout_is_ratio_fraction_low": 1 / 3,
            V + "rollout_is_std": math.sqrt(17 / 8 - 25 / 16),
            V + "rollout_is_eff_sample_size": (25 / 16) / (17 / 8),
            V + "rollout_is_seq_mean": 97 / 12,
            V + "rollout_is_seq_std": math.sqrt(sum((s - 97 / 12) ** 2 for s in seq) / 2),
            V + "rollout_is_seq_max": 16,
            V + "rollout_is_seq_min": 1 / 4,
            V + "rollout_is_seq_max_deviation": 15,
            V + "rollout_is_seq_fraction_high": 2 / 3,
            V + "rollout_is_seq_fraction_low": 1 / 3,
        },
    )
    # the diagnostics do not depend on the IS level
    token = run().batch
    assert all(run(rollout_is="sequence").batch[V + k] == token[V + k] for k in ("kl", "k3_kl", "chi2_seq"))


def test_prime_rl_mismatch_kl_by_hand():
    values = [K3_UP, K3_UP, K3_DOWN, K3_DOWN, K3_UP, K3_C]
    mean = sum(values) / 6
    check(
        run().batch,
        {
            P + "mean": mean,
            P + "median": K3_UP,  # sorted: K3_DOWN, K3_DOWN, K3_UP, K3_UP, K3_UP, K3_C
            P + "std": math.sqrt(sum((v - mean) ** 2 for v in values) / 5),
            P + "min": K3_DOWN,
            P + "max": K3_C,
        },
    )


def test_prime_rl_median_is_the_lower_middle_value():
    # x = [0, 2L, -2L, 3L]: values 0, K3_UP, K3_DOWN, K3_C; sorted 0 < K3_DOWN < K3_UP < K3_C
    got = run([[0.0, -L, -3 * L, -L]], [[0.0, -3 * L, -L, -4 * L]]).batch
    assert got[P + "median"] == pytest.approx(K3_DOWN, rel=1e-12)


def test_slime_by_hand():
    check(
        run().batch,
        {
            # per-request means of |x|: 2L, 2L, 3L (the token mean would be 13L/6)
            S + "train_rollout_logprob_abs_diff": 7 * L / 3,
            # per-request means of rho: 4, 3/2, 8; of |rho - 1|: 3, 3/2, 7
            S + "tis": 9 / 2,
            S + "tis_abs": 23 / 6,
            # rho > 2 per request: 2 of 2, 1 of 3, 1 of 1
            S + "tis_clipfrac": (1 + 1 / 3 + 1) / 3,
        },
    )


def test_thresholds():
    got = run(is_threshold=5.0, tis_clip_low=0.3).batch
    check(
        got,
        {
            V + "rollout_is_ratio_fraction_high": 1 / 6,  # w = 8
            V + "rollout_is_ratio_fraction_low": 0,  # none below 1/5
            V + "rollout_is_seq_fraction_high": 1 / 3,  # request means 4, 3/2, 8
            # clipped to [1/5, 5]: [4, 4, 1/4, 1/4, 4, 5]
            V + "rollout_is_std": math.sqrt((3 * 16 + 2 / 16 + 25) / 6 - ((12 + 1 / 2 + 5) / 6) ** 2),
            # A: none outside [0.3, 5]; B: the two 1/4; C: 8
            S + "tis_clipfrac": (0 + 2 / 3 + 1) / 3,
        },
    )


def test_threshold_comparisons_are_strict():
    # rho = 1 exactly, at C = 1: neither above C nor below 1/C, as in verl (w > C) and slime (clamp changes it)
    for level in ("token", "sequence"):
        got = run([[-1.0, -2.0]], [[-1.0, -2.0]], is_threshold=1.0, tis_clip_low=0.5, rollout_is=level).batch
        names = ("ratio_fraction_high", "ratio_fraction_low", "seq_fraction_high", "seq_fraction_low")
        assert [got[V + "rollout_is_" + k] for k in names] == [0, 0, 0, 0]
        assert got[S + "tis_clipfrac"] == 0


def test_per_request_values_are_the_request_alone():
    a, b, c = run().per_request
    check(a, {V + "training_ppl": 2, V + "rollout_ppl": 8, V + "kl": -2 * L, V + "ppl_ratio": 1 / 4})
    check(a, {V + "chi2_seq": 255, P + "std": 0, S + "train_rollout_logprob_abs_diff": 2 * L, S + "tis": 4})
    check(b, {V + "log_ppl_diff": 2 * L / 3, V + "log_ppl_abs_diff": 2 * L / 3, V + "rollout_is_seq_mean": 3 / 2})
    check(b, {V + "rollout_is_ratio_fraction_low": 2 / 3, S + "tis_clipfrac": 1 / 3, P + "median": K3_DOWN})
    # a single token: verl's std are 0.0 by definition, prime-rl's (torch's unbiased) std undefined
    check(c, {V + "rollout_is_std": 0, V + "rollout_is_seq_std": 0, V + "log_ppl_diff_max": -3 * L})
    assert c[P + "std"] is None
    check(c, {P + "mean": K3_C, P + "median": K3_C, V + "rollout_is_eff_sample_size": 1})


def test_swapped_sides_give_different_values():
    swapped = run(ROLLOUT, TRAIN).batch
    check(
        swapped,
        {
            V + "kl": 5 * L / 6,
            V + "training_ppl": (8 + 2 ** (5 / 3) + 16) / 3,
            # exp(-x) - (-x) - 1 per token: A 2 x K3_DOWN; B 2 x K3_UP + K3_DOWN; C 1/8 + 3L - 1
            V + "k3_kl": (3 * K3_DOWN + 2 * K3_UP + 3 * L - 7 / 8) / 6,
            S + "tis": (1 / 4 + (4 + 4 + 1 / 4) / 3 + 1 / 8) / 3,
            S + "train_rollout_logprob_abs_diff": 7 * L / 3,
        },
    )


def test_identity():
    t = [[-0.5, -2.0, -0.1], [-3.0]]
    got = run(t, t)
    for values in [got.batch, *got.per_request]:
        assert values[V + "training_ppl"] == values[V + "rollout_ppl"]
        zero = ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq", "rollout_is_std")
        assert all(values[V + k] == 0 for k in zero)
        one = ("ppl_ratio", "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_eff_sample_size")
        assert all(values[V + k] == 1 for k in one + ("rollout_is_seq_mean",))
        fractions = ("ratio_fraction_high", "ratio_fraction_low", "seq_fraction_high", "seq_fraction_low")
        assert all(values[V + "rollout_is_" + k] == 0 for k in fractions + ("seq_max_deviation",))
        assert values[P + "mean"] == values[P + "max"] == 0
        assert values[S + "train_rollout_logprob_abs_diff"] == values[S + "tis_abs"] == values[S + "tis_clipfrac"] == 0
        assert values[S + "tis"] == 1
    check(got.batch, {V + "training_log_ppl": (2.6 / 3 + 3.0) / 2})


def test_tiny_differences_keep_their_digits():
    x = 2.0**-27  # t - r exactly
    for sign in (1, -1):
        got = run([[-1.0 + sign * x, -1.0]], [[-1.0, -1.0]]).batch
        d = sign * x
        check(
            got,
            {
                V + "k3_kl": (d**2 / 2 + d**3 / 6) / 2,  # exp(d) - 1 - d would round to 0 or 2^-53
                P + "max": d**2 / 2 + d**3 / 6,
                V + "chi2_token": (2 * d + 2 * d**2 + 4 * d**3 / 3) / 2,
                V + "kl": -d / 2,
                V + "log_ppl_diff": -d / 2,
                S + "tis_abs": (x + d * x / 2) / 2,
            },
        )


def test_log_ppl_diff_of_a_tiny_difference():
    t1 = -0.7 + 1e-9
    delta = t1 - -0.7  # exact (Sterbenz); mean(r) - mean(t) would keep only about 7 of its digits
    got = run([[t1, -0.2]], [[-0.7, -0.2]]).batch
    check(
        got, {V + "log_ppl_diff": -delta / 2, V + "log_ppl_diff_max": -delta / 2, V + "ppl_ratio": math.exp(-delta / 2)}
    )


def test_large_ratios():
    # x = [710, 0]: exp(710) overflows float64, the means of exponentials do not
    got = run([[0.0, 0.0]], [[-710.0, 0.0]]).batch
    check(got, {S + "tis": math.exp(710 - L), V + "k3_kl": math.exp(710 - L), P + "mean": math.exp(710 - L)})
    assert got[P + "max"] is None and got[P + "std"] is None
    check(got, {V + "rollout_is_max": math.exp(20), V + "chi2_token": (math.exp(40) + 1) / 2 - 1})
    check(got, {V + "rollout_ppl": math.exp(355), V + "ppl_ratio": math.exp(-355)})
    # x = -800: rho underflows to 0
    got = run([[-800.0]], [[0.0]]).batch
    check(got, {V + "k3_kl": 799, S + "tis": 0, S + "tis_abs": 1, V + "rollout_is_min": math.exp(-20)})
    # at sequence level: the min is not bounded, the max only above, the weights of the mean both ways
    check(run([[-800.0]], [[0.0]], rollout_is="sequence").batch, {V + "rollout_is_min": 0, V + "rollout_is_max": 0})
    got = run([[0.0]], [[-21.0]], rollout_is="sequence").batch
    check(
        got,
        {V + "rollout_is_min": math.exp(21), V + "rollout_is_max": math.exp(20), V + "rollout_is_mean": math.exp(20)},
    )


def test_empty_requests_are_left_out_and_counted():
    got = run([[], [-1.0, -2.0], []], [[], [-1.5, -2.0], []])
    assert (got.requests, got.empty_requests, got.tokens) == (1, 2, 2)
    assert got.per_request[0] == got.per_request[2] == dict.fromkeys(METRIC_KEYS)
    assert got.batch == got.per_request[1]
    check(got.batch, {V + "training_ppl": math.exp(1.5), V + "kl": -0.25})
    none = run([[]], [[]])
    assert (none.requests, none.empty_requests, none.tokens) == (0, 1, 0)
    assert none.batch == dict.fromkeys(METRIC_KEYS)
    assert run([], []).batch == dict.fromkeys(METRIC_KEYS)


def test_keys():
    got = run()
    assert list(got.batch) == list(METRIC_KEYS)
    assert all(list(r) == list(METRIC_KEYS) for r in got.per_request)
    assert len(set(METRIC_KEYS)) == len(METRIC_KEYS) == 27 + 5 + 4


@pytest.mark.parametrize(
    "train, rollout, options, message",
    [
        ([[-1.0]], [], {}, r"^train has 1 requests, rollout 0$"),
        ([[-1.0, -2.0]], [[-1.0]], {}, r"^request 0: train has 2 logprobs, rollout 1$"),
        # names the place, not the value: the library's message carries no "(got ...)"
        ([[-1.0]], [[float("nan")]], {}, r"^rollout\[0\] holds a non-finite logprob$"),
        ([[[-1.0]]], [[[-1.0]]], {}, r"^train\[0\] must be 1-D \(got shape \(1, 1\)\)$"),
        # values unlike the other option's default (tis_clip_low 0.0, is_threshold 2.0), so a message
        # that prints the wrong one fails
        ([[-1.0]], [[-1.0]], {"is_threshold": -0.5}, r"^is_threshold must be positive and finite \(got -0\.5\)$"),
        ([[-1.0]], [[-1.0]], {"tis_clip_low": 2.5}, r"^tis_clip_low must be in \[0, is_threshold\) \(got 2\.5\)$"),
        (
            [[-1.0]],
            [[-1.0]],
            {"rollout_is": "geometric"},
            r"^rollout_is must be 'token' or 'sequence' \(got 'geometric'\)$",
        ),
    ],
)
def test_refusals(train, rollout, options, message):
    with pytest.raises(ValueError, match=message):
        rl_metrics(train=[np.array(t) for t in train], rollout=[np.array(r) for r in rollout], **options)


logprob = st.floats(-30.0, 0.0, allow_nan=False)
request = st.integers(0, 6).flatmap(lambda n: st.tuples(*[st.tuples(logprob, logprob)] * n))


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=1, max_size=5), st.sampled_from(["token", "sequence"]))
def test_properties(requests, level):
    train = [[p[0] for p in req] for req in requests]
    rollout = [[p[1] for p in req] for req in requests]
    got, swapped = run(train, rollout, rollout_is=level), run(rollout, train, rollout_is=level)
    kept = [(t, r, m) for t, r, m in zip(train, rollout, got.per_request) if t]
    if not kept:
        assert got.batch == dict.fromkeys(METRIC_KEYS)
        return
    b, s = got.batch, swapped.batch
    assert b[V + "k3_kl"] >= 0 and b[P + "min"] >= 0 and b[P + "mean"] >= 0
    assert b[V + "training_ppl"] > 0 and b[V + "rollout_ppl"] > 0 and b[V + "ppl_ratio"] > 0
    assert b[V + "log_ppl_abs_diff"] >= abs(b[V + "log_ppl_diff"]) - 1e-12
    assert 0 < b[V + "rollout_is_eff_sample_size"] <= 1 + 1e-12
    if level == "token":  # at sequence level verl bounds the mean's weights, the max only above, the min not at all
        assert b[V + "rollout_is_min"] <= b[V + "rollout_is_mean"] * (1 + 1e-12)
        assert b[V + "rollout_is_mean"] <= b[V + "rollout_is_max"] * (1 + 1e-12)
    for t, _, m in kept:
        assert m[V + "training_ppl"] == pytest.approx(math.exp(-sum(t) / len(t)), rel=1e-12)
        assert m[V + "ppl_ratio"] == pytest.approx(m[V + "training_ppl"] / m[V + "rollout_ppl"], rel=1e-9)
    # sequence means are plain means of the per-request values, token means are weighted by length
    n = [len(t) for t, _, _ in kept]
    for key in (V + "training_ppl", V + "log_ppl_diff", S + "train_rollout_logprob_abs_diff", S + "tis"):
        assert b[key] == pytest.approx(np.mean([m[key] for *_, m in kept]), rel=1e-9, abs=1e-12)
    for key in (V + "kl", V + "k3_kl", V + "chi2_token", P + "mean"):
        assert b[key] == pytest.approx(np.average([m[key] for *_, m in kept], weights=n), rel=1e-9, abs=1e-12)
    # swapping the sides
    assert s[V + "kl"] == pytest.approx(-b[V + "kl"], rel=1e-12, abs=1e-12)
    assert s[V + "log_ppl_diff"] == pytest.approx(-b[V + "log_ppl_diff"], rel=1e-12, abs=1e-12)
    assert s[V + "log_ppl_diff_max"] == pytest.approx(-b[V + "log_ppl_diff_min"], rel=1e-12, abs=1e-12)
    assert s[V + "training_ppl"] == b[V + "rollout_ppl"] and s[V + "rollout_log_ppl"] == b[V + "training_log_ppl"]
    assert s[S + "train_rollout_logprob_abs_diff"] == b[S + "train_rollout_logprob_abs_diff"]
