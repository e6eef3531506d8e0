"""Plots and summary tables from the JSON results in ``bench/results/``.

Reads whatever of ``scaling.json``, ``placement.json``, ``staging.json``, ``launch.json`` (and,
when present, ``jax_step.json``) exists and writes, next to them:

- ``cost_vs_batch.png``: cost per replay step vs batch size, log-log. Left: each path (torch
  eager host time, CUDA graph replay host time, kernel device time, JAX rows when present) for
  each placement, 8K-token traces (``scaling.json``). Right: kernel device time for each trace
  length and placement (``placement.json``). Lines are p50, bands p20-p80.
- ``staging_bandwidth.png``: GB/s of ``stage`` and ``stage_many`` (with the native copy and with
  numpy's), of the commit on the device
  and end to end, per (traces x tokens) and placement, next to the copy ceilings measured in the
  same run and, as black marks, the bare host copy of the same bytes (``staging.json``).
- ``summary.md``: the Markdown tables that ``bench/README.md`` quotes.

Missing inputs are skipped with a message. Uses matplotlib's Agg backend (no display).
Run: ``python bench/plots.py [results_dir]`` (default: ``bench/results``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import RESULTS_DIR, table  # noqa: E402

STYLE = {"device": "-", "host_mapped": "--"}
PATH_LABELS = {
    "torch_eager": "torch eager (host time)",
    "torch_cuda_graph": "CUDA graph replay (host time)",
    "kernel_device": "kernel (device time)",
    "jax_jit": "JAX inside jit (added per fori_loop step)",
    "jax_jit_baseline": "JAX fori_loop step without replay",
}
# (metric, api, label); rows written before the api axis existed count as api "stage"
STAGING_METRICS = (
    ("stage_host", "stage", "stage, one call per trace (host)"),
    ("stage_host", "stage_many", "stage_many, one call (host)"),
    ("stage_host", "stage_many_numpy", "stage_many, numpy's copy (host)"),
    ("commit_device", "stage", "commit (device)"),
    ("end_to_end", "stage", "stage + commit + sync"),
    ("end_to_end", "stage_many", "stage_many + commit + sync"),
)


def load(results: str, name: str):
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        print(f"{name}.json: not found, skipped")
        return None
    with open(path) as f:
        return json.load(f)


def machine(rows) -> str:
    r = rows[0]
    v = r.get("versions") or {}
    return (
        f"{r.get('gpu')}, driver {r.get('driver')}, torch {v.get('torch')}, triton {v.get('triton')}, "
        f"{str(r.get('date', ''))[:10]}"
    )


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
        colors = {}
        for p in providers:
            for placement_name in ("device", "host_mapped", None):
                xs, rs = series(rows, provider=p, placement=placement_name)
                if not rs:
                    continue
                kw = dict(
                    linestyle=STYLE.get(placement_name, ":"),
                    label=f"{PATH_LABELS.get(p, p)}, {placement_name or 'n/a'}",
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

    rows = [r for r in staging if r.get("kind") == "staging"]
    placements = [p for p in ("device", "host_mapped") if any(r["placement"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(placements), figsize=(7 * len(placements), 6.4), squeeze=False)
    for ax, placement_name in zip(axes[0], placements):
        sub = [r for r in rows if r["placement"] == placement_name]
        configs = sorted({(r["n_traces"], r["trace_tokens"]) for r in sub})
        width = 0.8 / len(STAGING_METRICS)
        for m, (metric, api, label) in enumerate(STAGING_METRICS):
            pts = {
                (r["n_traces"], r["trace_tokens"]): r
                for r in sub
                if r["metric"] == metric and r.get("api", "stage") == api
            }
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


def summary(results, launch, staging, placement, scaling, logprob=None) -> None:
    parts = ["# Benchmark summary (generated by bench/plots.py from the JSON results)", ""]
    for name, rows in (
        ("launch", launch),
        ("staging", staging),
        ("placement", placement),
        ("scaling", scaling),
        ("logprob_rank", logprob),
    ):
        if rows:
            parts += [f"Machine for {name}.json: {machine(rows)}", ""]
    if launch:
        providers = list(dict.fromkeys(r["provider"] for r in launch))
        batches = sorted({r["batch"] for r in launch})
        t = []
        for p in providers:
            for placement_name in ("device", "host_mapped"):
                cells = {r["batch"]: r for r in launch if r["provider"] == p and r["placement"] == placement_name}
                if cells:
                    row = dict(provider=p, placement=placement_name)
                    for b in batches:
                        c = cells.get(b)
                        row[f"B={b}"] = f"{c['us_p50']:.2f} ({c['us_p20']:.2f}-{c['us_p80']:.2f})" if c else ""
                    t.append(row)
        parts += [
            "## launch.py: host us per step, p50 (p20-p80)",
            "",
            table(t, ["provider", "placement"] + [f"B={b}" for b in batches]),
            "",
        ]
    if staging:
        parts += [
            "## staging.py: ceilings",
            "",
            table(
                [r for r in staging if r.get("kind") == "ceiling"],
                ["ceiling", "bytes", "gbps_p50", "gbps_p20", "gbps_p80"],
            ),
            "",
            "## staging.py: the copy alone (no id check, no bookkeeping), against host_memcpy",
            "",
            table(
                [
                    dict(r, fraction_of_ceiling=f"{r['fraction_of_ceiling']:.0%}")
                    for r in staging
                    if r.get("kind") == "bare_copy"
                ],
                ["n_traces", "trace_tokens", "us_p50", "us_p20", "us_p80", "gbps_p50", "fraction_of_ceiling"],
            ),
            "",
            "## staging.py: GB/s = traces x tokens x 4 B / time",
            "",
            table(
                [
                    dict(
                        r,
                        fraction_of_ceiling=(
                            f"{r['fraction_of_ceiling']:.0%}" if r.get("fraction_of_ceiling") is not None else ""
                        ),
                    )
                    for r in staging
                    if r.get("kind") == "staging"
                ],
                [
                    "placement",
                    "api",
                    "copy",
                    "n_traces",
                    "trace_tokens",
                    "metric",
                    "us_p50",
                    "gbps_p50",
                    "ceiling",
                    "fraction_of_ceiling",
                ],
            ),
            "",
        ]
    if placement:
        timing = {
            (r["trace_tokens"], r["batch"], r["placement"], r["provider"]): r["us_p50"]
            for r in placement
            if r.get("kind") == "timing" and r.get("provider") != "event_floor"
        }
        keys = sorted({(k[0], k[1]) for k in timing})
        t = [
            dict(
                trace_tokens=L,
                batch=b,
                device_kernel_us=timing.get((L, b, "device", "kernel_device")),
                host_mapped_kernel_us=timing.get((L, b, "host_mapped", "kernel_device")),
                device_adapter_host_us=timing.get((L, b, "device", "torch_adapter_host")),
                host_mapped_adapter_host_us=timing.get((L, b, "host_mapped", "torch_adapter_host")),
            )
            for L, b in keys
        ]
        floor = [r for r in placement if r.get("provider") == "event_floor"]
        parts += [
            "## placement.py: us per replay step, p50",
            "",
            (f"Event floor (empty do_bench): {floor[0]['us_p50']:.2f} us" if floor else ""),
            "",
            table(
                t,
                [
                    "trace_tokens",
                    "batch",
                    "device_kernel_us",
                    "host_mapped_kernel_us",
                    "device_adapter_host_us",
                    "host_mapped_adapter_host_us",
                ],
            ),
            "",
            "## placement.py: memory",
            "",
            table(
                [r for r in placement if r.get("kind") == "memory"],
                [
                    "trace_tokens",
                    "max_slots",
                    "placement",
                    "table_bytes",
                    "table_memory",
                    "gpu_bytes_formula",
                    "gpu_bytes_measured",
                    "pinned_host_bytes_formula",
                ],
            ),
            "",
        ]
    if scaling:
        timing = {
            (r["provider"], r["placement"], r["batch"]): r["us_p50"] for r in scaling if r.get("kind") == "timing"
        }
        providers = [p for p in PATH_LABELS if any(k[0] == p for k in timing)]
        keys = sorted({(k[1], k[2]) for k in timing if k[1] is not None})
        t = [dict(placement=pl, batch=b, **{p: timing.get((p, pl, b)) for p in providers}) for pl, b in keys]
        floor = [r for r in scaling if r.get("provider") == "event_floor"]
        parts += [
            "## scaling.py: us per step, p50",
            "",
            (f"Event floor (empty do_bench): {floor[0]['us_p50']:.2f} us" if floor else ""),
            "",
            table(t, ["placement", "batch"] + providers),
            "",
            "## scaling.py: where the kernel dominates",
            "",
            table(
                [r for r in scaling if r.get("kind") == "crossover"],
                ["placement", "path", "kernel_dominates_from_batch"],
            ),
            "",
            "## scaling.py: memory-traffic floor at the largest batch",
            "",
            table(
                [r for r in scaling if r.get("kind") == "floor"],
                ["placement", "batch", "model", "bytes_per_row", "floor_ns", "kernel_us_p50", "kernel_over_floor"],
            ),
            "",
        ]
    if logprob:
        copy = next((r for r in logprob if r.get("provider") == "d2d_copy"), None)
        parts += [
            "## logprob_rank.py: us per call and GB/s of logits read, p50",
            "",
            (f"Device-to-device copy: {copy['gbps']:.0f} GB/s (read + write)" if copy else ""),
            "",
            table(
                [r for r in logprob if r.get("provider") not in ("d2d_copy", "target")],
                ["provider", "timing", "dtype", "batch", "vocab", "row_stride", "us_p50", "us_p20", "us_p80", "gbps"],
            ),
            "",
            table(
                [r for r in logprob if r.get("provider") == "target"],
                ["dtype", "batch", "timing", "field", "value", "limit", "met"],
            ),
            "",
        ]
    floor = load(results, "read_floor")
    if floor:
        parts += [
            "## read_floor.py: the simplest kernels that read the logits once, p50",
            "",
            table(floor, ["provider", "dtype", "batch", "us_p50", "us_p20", "us_p80", "gbps_p50", "share_of_copy"]),
            "",
        ]
    out = os.path.join(results, "summary.md")
    with open(out, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {out}")


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    results = sys.argv[1] if len(sys.argv) > 1 else RESULTS_DIR
    launch, staging = load(results, "launch"), load(results, "staging")
    placement, scaling = load(results, "placement"), load(results, "scaling")
    jax_step = load(results, "jax_step") if os.path.exists(os.path.join(results, "jax_step.json")) else None
    if scaling or placement:
        cost_vs_batch(results, scaling, placement, jax_step)
    if staging:
        staging_bandwidth(results, staging)
    summary(results, launch, staging, placement, scaling, load(results, "logprob_rank"))


if __name__ == "__main__":
    main()
