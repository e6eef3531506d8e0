"""Plots from the JSON results in ``bench/results/`` (the tables come from ``summary.py``).

Reads whatever of ``scaling.json``, ``placement.json``, ``staging.json`` (and, when present,
``jax_step.json``) exists and writes, next to them:

- ``cost_vs_batch.png``: cost per replay step vs batch size, log-log. Left: each path (torch
  eager host time, CUDA graph replay host time, kernel device time, JAX rows when present) for
  each placement, 8K-token traces (``scaling.json``). Right: kernel device time for each trace
  length and placement (``placement.json``). Lines are p50, bands p20-p80.
- ``staging_bandwidth.png``: GB/s of ``stage`` and ``stage_many``, of the commit on the device
  and end to end, per (traces x tokens) and placement, next to the copy ceilings measured in the
  same run and, as black marks, the bare host copy of the same bytes (``staging.json``).

Missing inputs are skipped with a message. Uses matplotlib's Agg backend (no display).
Run: ``python bench/plots.py [--results DIR]`` (default: ``bench/results``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import RESULTS_DIR, parse_args  # noqa: E402
from summary import load as load_rows  # noqa: E402
from summary import machine, staging_rows  # noqa: E402

STYLE = {"device": "-", "host_mapped": "--"}
PATH_LABELS = {
    "torch_eager": "torch eager (host time)",
    "torch_cuda_graph": "CUDA graph replay (host time)",
    "kernel_device": "kernel (device time)",
    "jax_jit": "JAX inside jit (added per fori_loop step)",
    "jax_jit_baseline": "JAX fori_loop step without replay",
}
# (metric, api, label)
STAGING_METRICS = (
    ("stage_host", "stage", "stage, one call per trace (host)"),
    ("stage_host", "stage_many", "stage_many, one call (host)"),
    ("commit_device", "stage", "commit (device)"),
    ("end_to_end", "stage", "stage + commit + sync"),
    ("end_to_end", "stage_many", "stage_many + commit + sync"),
)


def load(results: str, name: str):
    rows = load_rows(results, name)
    if rows is None:
        print(f"{name}.json: not found, skipped")
    return rows


def band(ax, xs, rs, **kw):
    ys = [r["us_p50"] for r in rs]
    (line,) = ax.plot(xs, ys, marker="o", markersize=3, **kw)
    ax.fill_between(
        xs,
        [r.get("us_p20", r["us_p50"]) for r in rs],
        [r.get("us_p80", r["us_p50"]) for r in rs],
        color=line.get_color(),
        alpha=0.15,
    )


def tokens_label(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def batch_axis(ax, rows) -> None:
    batches = sorted({r["batch"] for r in rows if isinstance(r.get("batch"), int)})
    ax.set_xscale("log")
    if batches:
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        from matplotlib.ticker import NullLocator

        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("batch (rows per step)")


def series(rows, **match):
    out = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and isinstance(r.get("batch"), int)]
    out.sort(key=lambda r: r["batch"])
    return [r["batch"] for r in out], out


def cost_vs_batch(results, scaling, placement, jax_step) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    ax = axes[0]
    if scaling:
        rows = [r for r in scaling if r.get("kind") == "timing"] + [
            dict(r, kind="timing") for r in (jax_step or []) if "us_p50" in r and isinstance(r.get("batch"), int)
        ]
        providers = [p for p in PATH_LABELS if any(r.get("provider") == p for r in rows)]
        providers += sorted(
            {
                r["provider"]
                for r in rows
                if "provider" in r
                and r["provider"] not in PATH_LABELS
                and r["provider"] != "event_floor"
                and isinstance(r.get("batch"), int)
            }
        )
        colors: dict[str, str] = {}
        for p in providers:
            for placement_name in ("device", "host_mapped", None):
                xs, rs = series(rows, provider=p, placement=placement_name)
                if not rs:
                    continue
                kw = dict(
                    linestyle=STYLE.get(placement_name or "", ":"),
                    label=f"{PATH_LABELS.get(str(p), p)}, {placement_name or 'n/a'}",
                )
                if p in colors:
                    kw["color"] = colors[p]
                band(ax, xs, rs, **kw)
                colors[p] = ax.lines[-1].get_color()
        floor = [r for r in scaling if r.get("provider") == "event_floor"]
        if floor:
            ax.axhline(
                floor[0]["us_p50"], color="grey", linewidth=0.8, linestyle=":", label="event floor (empty do_bench)"
            )
        ax.set_title("Replay cost per step, 4096 slots x 8K tokens", fontsize=10)
        ax.set_yscale("log")
        batch_axis(ax, rows)
        ax.set_ylabel("us per step (p50; band p20-p80)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "scaling.json: results pending", ha="center", va="center")
    ax = axes[1]
    if placement:
        rows = [r for r in placement if r.get("kind") == "timing" and r.get("provider") == "kernel_device"]
        lengths = sorted({r["trace_tokens"] for r in rows})
        cmap = plt.get_cmap("viridis")
        for j, length in enumerate(lengths):
            color = cmap(j / max(1, len(lengths) - 1) * 0.9)
            for placement_name in ("device", "host_mapped"):
                xs, rs = series(rows, trace_tokens=length, placement=placement_name)
                if rs:
                    band(
                        ax,
                        xs,
                        rs,
                        linestyle=STYLE[placement_name],
                        color=color,
                        label=f"{tokens_label(length)} tokens, {placement_name}",
                    )
        ax.set_title("Kernel device time by table placement and trace length", fontsize=10)
        ax.set_yscale("log")
        batch_axis(ax, rows)
        ax.set_ylabel("us per replay kernel (p50; band p20-p80)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="best")
    else:
        ax.text(0.5, 0.5, "placement.json: results pending", ha="center", va="center")
    src = scaling or placement
    if src:
        fig.suptitle(machine(src), fontsize=9)
    save(fig, results, "cost_vs_batch.png")


def save(fig, results, name: str) -> None:
    """Lay out ``fig``, write it to ``results/name`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = os.path.join(results, name)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def staging_bandwidth(results, staging) -> None:
    import matplotlib.pyplot as plt

    rows = staging_rows(staging)
    placements = [p for p in ("device", "host_mapped") if any(r["placement"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(placements), figsize=(7 * len(placements), 6.4), squeeze=False)
    for ax, placement_name in zip(axes[0], placements):
        sub = [r for r in rows if r["placement"] == placement_name]
        configs = sorted({(r["n_traces"], r["trace_tokens"]) for r in sub})
        width = 0.8 / len(STAGING_METRICS)
        for m, (metric, api, label) in enumerate(STAGING_METRICS):
            pts = {(r["n_traces"], r["trace_tokens"]): r for r in sub if r["metric"] == metric and r["api"] == api}
            xs = [i + (m - (len(STAGING_METRICS) - 1) / 2) * width for i in range(len(configs))]
            ys = [pts[c]["gbps_p50"] if c in pts else 0.0 for c in configs]
            lo = [max(0.0, y - pts[c]["gbps_p20"]) if c in pts else 0.0 for c, y in zip(configs, ys)]
            hi = [max(0.0, pts[c]["gbps_p80"] - y) if c in pts else 0.0 for c, y in zip(configs, ys)]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label)
        # The copy alone (no id check, no bookkeeping), where the run measured it: host-only, so
        # the same marks on both panels.
        bare = {(r["n_traces"], r["trace_tokens"]): r for r in staging if r.get("kind") == "bare_copy"}
        marks = [(i, bare[c]["gbps_p50"]) for i, c in enumerate(configs) if c in bare]
        if marks:
            ax.plot(
                [i for i, _ in marks],
                [g for _, g in marks],
                linestyle="none",
                marker="_",
                markersize=30,
                markeredgewidth=1.5,
                color="black",
                zorder=3,
                label="the copy alone, no check (host, np.copyto)",
            )
        # The ceiling each bar is compared with (staging.py's docstring says which is which).
        colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
        for (metric, api, label), color in zip(STAGING_METRICS, colors):
            if api != "stage":
                continue  # same ceiling as the stage bars
            ceiling = next((r for r in sub if r["metric"] == metric and r.get("ceiling_gbps")), None)
            if ceiling:
                g = ceiling["ceiling_gbps"]
                ax.axhline(
                    g,
                    color=color,
                    linestyle="--",
                    linewidth=1,
                    label=f"ceiling for {label}: {ceiling['ceiling']} {g:.1f} GB/s",
                )
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{n} x {tokens_label(t)}" for n, t in configs], rotation=30, fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("new traces x tokens per trace (one commit)")
        ax.set_ylabel("GB/s = traces x tokens x 4 B / time (p50; bars p20-p80)")
        ax.set_title(f"Staging, table placement = {placement_name}", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, markerscale=0.4)
    fig.suptitle(machine(staging), fontsize=9)
    save(fig, results, "staging_bandwidth.png")


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default=RESULTS_DIR, help="folder of the results files (read and written)")
    results = parse_args(__doc__, parser).results
    staging = load(results, "staging")
    placement, scaling = load(results, "placement"), load(results, "scaling")
    jax_step = load(results, "jax_step")
    if scaling or placement:
        cost_vs_batch(results, scaling, placement, jax_step)
    if staging:
        staging_bandwidth(results, staging)


if __name__ == "__main__":
    main()
