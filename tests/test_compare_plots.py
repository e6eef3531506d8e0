"""The compare plot's importance-ratio histogram: a log axis of plain numbers when the ratios
span a factor of 2 or more, else the ratio minus 1 on a linear axis scaled by a power of ten
named in the label; one colour per pair, the same in both panels."""

from __future__ import annotations

import numpy as np
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


def _bins(ax):
    """Per histogram drawn on ``ax`` (its step outline, in drawing order): ``(left, right,
    count)`` of each bin."""
    return [
        [(x0, x1, y0) for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]) if y0 == y1 and x0 < x1]
        for xy in (patch.get_xy() for patch in ax.patches)
    ]


OTHER = [1e-7, 0.0, -1e-7]  # the second pair's logprob differences


@pytest.mark.parametrize(
    "diffs, scale, label",
    [
        ([3e-7, -2e-7, 0.0], 1e-7, "per-token importance ratio - 1 (x 1e-07)"),
        ([2e-5, -4e-5, 1e-5], 1e-5, "per-token importance ratio - 1 (x 1e-05)"),  # more below 1 than above
        ([0.9, -0.2, 0.0], None, "per-token importance ratio exp(logprob b - logprob a)"),  # None: log axis
    ],
)
def test_ratio_axis_follows_the_spread(diffs, scale, label):
    ax = Figure().subplots()
    _ratio_histogram(ax, _report(diffs, [("torch-score", OTHER)]))
    assert (ax.get_xscale() == "log") is (scale is None)
    assert ax.get_xlabel() == label
    colors = [h.get_edgecolor() for h in ax.get_legend().legend_handles]
    assert len(colors) == 2 and colors[0] != colors[1]
    if scale is None:  # plain numbers, not powers of ten
        assert ax.xaxis.get_major_formatter()(2.0, 0) == "2"
    # every token counted in the bin of its ratio (minus 1, in units of the scale named), the
    # vertical line at no difference
    for d, bins in zip((diffs, OTHER), _bins(ax), strict=True):
        at = np.exp(d) if scale is None else (np.exp(d) - 1) / scale
        assert [y for _, _, y in bins] == [sum(x0 <= x < x1 for x in at) for x0, x1, _ in bins], at
        assert sum(y for _, _, y in bins) == len(d)
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [1.0 if scale is None else 0.0]


def test_pair_colours_match_across_panels(tmp_path):
    report = _report([1e-6, 2e-6], [("torch-score", [3e-7, 1e-7]), ("jax-score", [5e-7, 4e-7])])
    left, right = divergence_figure(report).axes
    means = {line.get_label().removeprefix("mean, "): line.get_color() for line in left.get_lines()
             if line.get_label().startswith("mean, ")}  # fmt: skip
    bars = {text.get_text(): handle.get_edgecolor() for text, handle in
            zip(right.get_legend().get_texts(), right.get_legend().legend_handles)}  # fmt: skip
    assert set(means) == {"torch vs jax", "torch vs torch-score", "torch vs jax-score"}  # as the terminal names them
    for name, color in means.items():
        a, b = name.split(" vs ")
        assert to_rgba(bars[f"{b} / {a}"]) == to_rgba(color), name
    assert len(set(means.values())) == 3
    plot_divergence(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
