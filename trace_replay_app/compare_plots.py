"""Plots of a ``compare`` report (matplotlib, imported on first use; no pyplot: no global state)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .compare import pair_reports

__all__ = ["plot_divergence", "divergence_figure"]

# One colour per pair, the same in both panels; red and orange mark the first pair's maximum and
# the argmax divergences.
PAIR_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def _pair_name(pair: dict[str, Any]) -> str:
    """``"a vs b"``: the reference first, as the terminal and the gates name a pair."""
    a, b = pair["summary"]["frameworks"]
    return f"{a} vs {b}"


def plot_divergence(report: dict[str, Any], path: str, *, title: str | None = None) -> None:
    """Draw into the PNG file ``path`` (atomically), left: ``|logprob difference|`` against
    position, every compared token of the first pair as a faint dot, its per-position maximum,
    every pair's per-position mean (one colour per pair, as on the right), a marker at each
    request's first argmax divergence; right: the histogram of per-token importance ratios
    ``exp(logprob b - logprob a)`` of every pair."""
    fig = divergence_figure(report, title=title)
    from .traces import atomic_write  # after matplotlib: a missing plot library writes nothing

    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")


def divergence_figure(report: dict[str, Any], *, title: str | None = None) -> Any:
    """The figure :func:`plot_divergence` writes, as a matplotlib ``Figure`` with its own Agg
    canvas (no pyplot: no global backend or figure state changes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a, b = report["summary"]["frameworks"]
    fig = Figure(figsize=(13, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax, hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    xs, ys = [], []
    for r in report["requests"]:
        for pos, d in enumerate(r["logprob_diff"]):
            if d is not None:
                xs.append(pos)
                ys.append(abs(d))
    if xs:
        ax.scatter(xs, ys, s=10, alpha=0.5, color="tab:gray", label=f"one token, {_pair_name(report)}",
                   linewidths=0, zorder=3)  # fmt: skip
    per = report["per_position"]
    if per:
        at = [p["position"] for p in per]
        ax.plot(at, [p["max_abs_logprob_diff"] for p in per], color="tab:red", label=f"max, {_pair_name(report)}")
    for color, pair in zip(PAIR_COLORS, pair_reports(report)):
        per_pair = pair["per_position"]
        if per_pair:
            ax.plot([p["position"] for p in per_pair], [p["mean_abs_logprob_diff"] for p in per_pair],
                    color=color, label=f"mean, {_pair_name(pair)}")  # fmt: skip
    divs = [r["first_argmax_divergence"] for r in report["requests"] if r["first_argmax_divergence"] is not None]
    for i, d in enumerate(sorted(set(divs))):
        ax.axvline(
            d, color="tab:orange", linestyle="--", linewidth=1, label="first argmax divergence" if i == 0 else None
        )
    # symlog: exact agreement (0) stays on the plot, small differences still spread out
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("decode position (tokens after the prompt)")
    ax.set_ylabel("|logprob difference| (nats)")
    s = report["summary"]
    ax.set_title(
        title
        or f"{a} vs {b}: {s['requests']} requests, max |diff| "
        f"{'n/a' if s['max_abs_logprob_diff'] is None else format(s['max_abs_logprob_diff'], '.2g')}"
    )
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    _ratio_histogram(hist, report)
    fig.tight_layout()
    return fig


def _ratio_histogram(ax: Any, report: dict[str, Any]) -> None:
    """Per pair, the histogram of ``exp(b - a)`` over its compared tokens with finite logprobs:
    log-spaced bins on a log axis when the ratios span a factor of 2 or more (the range
    truncated importance sampling cuts), else the ratio minus 1 on a linear axis in a power of
    ten named in the label."""
    ratios = []
    for color, pair in zip(PAIR_COLORS, pair_reports(report)):
        a, b = pair["summary"]["frameworks"]
        d = [x for r in pair["requests"] for x in r["logprob_diff"] if x is not None]
        ratios.append((f"{b} / {a}", color, np.exp(np.clip(np.asarray(d, np.float64), -50, 50))))
    values = np.concatenate([r for _, _, r in ratios]) if ratios else np.zeros(0)
    label = "per-token importance ratio exp(logprob b - logprob a)"
    if values.size:
        lo, hi = float(values.min()), float(values.max())
        wide = hi / lo >= 2
        scale = 1.0
        if wide:
            bins = np.geomspace(lo / 1.05, hi * 1.05, 41)
        else:
            half = max(hi - 1, 1 - lo, 1e-12)
            scale = 10.0 ** np.floor(np.log10(half))
            bins = np.linspace(-1.05 * half / scale, 1.05 * half / scale, 41)
            label = f"per-token importance ratio - 1 (x {scale:.0e})"
        for name, color, r in ratios:
            if r.size:
                ax.hist(r if wide else (r - 1) / scale, bins=bins, histtype="step", label=name, color=color)
        if wide:  # plain numbers (0.5, 1, 2), not powers of ten
            from matplotlib.ticker import FuncFormatter

            ax.set_xscale("log")
            plain = FuncFormatter(lambda x, _: f"{x:g}")
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(plain)
        ax.axvline(1.0 if wide else 0.0, color="black", linewidth=0.8, alpha=0.5)
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel(label)
    ax.set_ylabel("tokens")
    ax.grid(True, which="major", alpha=0.3)
