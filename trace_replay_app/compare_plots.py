"""Plots of a ``compare`` report (matplotlib, imported on first use; no pyplot: no global state)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .compare import pair_reports

__all__ = ["plot_divergence"]


def plot_divergence(report: dict[str, Any], path: str, *, title: str | None = None) -> None:
    """Draw into the PNG file ``path`` (atomically), left: ``|logprob difference|`` against
    position, every compared token of the first pair as a faint dot, its per-position maximum
    and mean as lines (the other pairs' means too), a marker at each request's first argmax
    divergence; right: the histogram of per-token importance ratios ``exp(logprob b - logprob
    a)`` of every pair (log-spaced bins)."""
    # A Figure with its own Agg canvas: no pyplot, so no global backend or figure state changes.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .traces import atomic_write  # noqa: I001 - after matplotlib: a missing plot library writes nothing

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
        ax.scatter(xs, ys, s=10, alpha=0.5, color="tab:gray", label="one token", linewidths=0, zorder=3)
    per = report["per_position"]
    if per:
        at = [p["position"] for p in per]
        ax.plot(at, [p["max_abs_logprob_diff"] for p in per], color="tab:red", label="max over requests")
        ax.plot(at, [p["mean_abs_logprob_diff"] for p in per], color="tab:blue", label="mean over requests")
    for other in report.get("pairs", []):
        per_other = other["per_position"]
        if per_other:
            label = "mean, {} vs {}".format(*other["summary"]["frameworks"])
            ax.plot([p["position"] for p in per_other], [p["mean_abs_logprob_diff"] for p in per_other], label=label)
    divs = [r["first_argmax_divergence"] for r in report["requests"] if r["first_argmax_divergence"] is not None]
    for i, d in enumerate(sorted(set(divs))):
        ax.axvline(
            d, color="tab:orange", linestyle="--", linewidth=1, label="first argmax divergence" if i == 0 else None
        )
    # symlog: exact agreement (0) stays on the plot, small differences still spread out
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("decode position (tokens after the prompt)")
    ax.set_ylabel(f"|logprob {b} - logprob {a}|")
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
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")


def _ratio_histogram(ax: Any, report: dict[str, Any]) -> None:
    """Per pair, the histogram of ``exp(b - a)`` over its compared tokens with finite logprobs."""
    ratios = []
    for pair in pair_reports(report):
        a, b = pair["summary"]["frameworks"]
        d = [x for r in pair["requests"] for x in r["logprob_diff"] if x is not None]
        ratios.append((f"{b} / {a}", np.exp(np.clip(np.asarray(d, np.float64), -50, 50))))
    values = np.concatenate([r for _, r in ratios]) if ratios else np.zeros(0)
    if values.size:
        lo, hi = float(values.min()), float(values.max())
        spread = max(hi / lo, 1 + 1e-6)
        bins = np.geomspace(lo / spread**0.05, hi * spread**0.05, 41)
        for label, r in ratios:
            if r.size:
                ax.hist(r, bins=bins, histtype="step", label=label)
        ax.set_xscale("log")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("per-token importance ratio exp(logprob b - logprob a)")
    ax.set_ylabel("tokens")
    ax.grid(True, which="major", alpha=0.3)
