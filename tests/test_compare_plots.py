"""The compare plot's importance-ratio histogram: a log axis of plain numbers when the ratios
span a factor of 2 or more, else the ratio minus 1 on a linear axis scaled by a power of ten
named in the label; one colour per pair, the same in both panels."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from trace_replay_app.compare_plots import _ratio_histogram, divergence_figure, plot_divergence  # noqa: E402


def _report(diffs, others=()):
    def pair(a, b, d):
        return {
            "summary": {"frameworks": [a, b], "requests": 1, "max_abs_logprob_diff": max(map(abs, d))},
            "requests": [{"logprob_diff": list(d) + [None], "first_argmax_divergence": None}],
            "per_position": [
                {"position": i, "max_abs_logprob_diff": abs(x), "mean_abs_logprob_diff": abs(x)}
                for i, x in enumerate(d)
            ],  # fmt: skip
        }

    top = pair("torch", "jax", diffs)
    top["pairs"] = [pair("torch", name, d) for name, d in others]
    return top


@pytest.mark.parametrize(
    "diffs, log_axis, label",
    [
        ([3e-7, -2e-7, 0.0], False, "per-token importance ratio - 1 (x 1e-07)"),
        ([0.9, -0.2, 0.0], True, "per-token importance ratio exp(logprob b - logprob a)"),
    ],
)
def test_ratio_axis_follows_the_spread(diffs, log_axis, label):
    ax = Figure().subplots()
    _ratio_histogram(ax, _report(diffs, [("torch-score", [1e-7, 0.0, 0.0])]))
    assert (ax.get_xscale() == "log") is log_axis
    assert ax.get_xlabel() == label
    colors = [h.get_edgecolor() for h in ax.get_legend().legend_handles]
    assert len(colors) == 2 and colors[0] != colors[1]
    if log_axis:  # plain numbers, not powers of ten
        assert ax.xaxis.get_major_formatter()(2.0, 0) == "2"


def test_pair_colours_match_across_panels(tmp_path):
    report = _report([1e-6, 2e-6], [("torch-score", [3e-7, 1e-7]), ("jax-score", [5e-7, 4e-7])])
    left, right = divergence_figure(report).axes
    means = {line.get_label().removeprefix("mean, "): line.get_color() for line in left.get_lines()
             if line.get_label().startswith("mean, ")}  # fmt: skip
    bars = {text.get_text(): handle.get_edgecolor() for text, handle in
            zip(right.get_legend().get_texts(), right.get_legend().legend_handles)}  # fmt: skip
    assert set(means) == {"jax vs torch", "torch-score vs torch", "jax-score vs torch"}
    for name, color in means.items():
        b, a = name.split(" vs ")
        assert to_rgba(bars[f"{b} / {a}"]) == to_rgba(color), name
    assert len(set(means.values())) == 3
    plot_divergence(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
