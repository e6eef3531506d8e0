"""Today's figures, generated from the results files in ``bench/results/``.

Writes two things from the JSON results (nothing else is read, nothing measured):

- the figures section of ``bench/README.md``, between the lines ``<!-- figures:begin -->`` and
  ``<!-- figures:end -->``: one short table per bench, each under the machine, date and commit
  of its results file;
- ``bench/results/summary.md``: the same section followed by the full tables.

A results file that is missing is named as missing. Figures are p50 unless a column says
otherwise. Run: ``python bench/summary.py`` (no GPU needed; ``bench/run_all.sh`` runs it last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import RESULTS_DIR, parse_args, table  # noqa: E402

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
QUEUED = "cuda events, queued behind a busy kernel"

Rows = list[dict]


def load(results: str, name: str) -> Rows | None:
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def machine(rows: Rows) -> str:
    """GPU, driver, versions, date and commit of a results file (its first row)."""
    r = rows[0]
    v = r.get("versions") or {}
    commit = r.get("commit")
    if commit:
        commit = f"commit {commit[:10]}" + (" (dirty)" if r.get("dirty") else "")
        if r.get("provenance"):
            commit += f", {r['provenance']}"
    return (
        f"{r.get('gpu')}, driver {r.get('driver')}, torch {v.get('torch')}, triton {v.get('triton')}, "
        f"jax {v.get('jax')}; {str(r.get('date', ''))[:16].replace('T', ' ')} UTC; {commit or 'commit unknown'}"
    )


def us(r: dict | None) -> str:
    return f"{r['us_p50']:.2f}" if r and r.get("us_p50") is not None else ""


def grid(rows: Rows, row_key, col_key, cell) -> tuple[Rows, list]:
    """A pivot: one output row per ``row_key(r)`` (a dict of leading columns), one column per
    ``col_key(r)``, each cell ``cell(r)``."""
    cols = sorted({col_key(r) for r in rows})
    out: dict[tuple, dict] = {}
    for r in rows:
        lead = row_key(r)
        out.setdefault(tuple(lead.items()), dict(lead))[col_key(r)] = cell(r)
    return list(out.values()), cols


def pivot_table(rows: Rows, row_key, col_key, cell, lead: list[str], label=str) -> str:
    t, cols = grid(rows, row_key, col_key, cell)
    named = [{**{k: r[k] for k in lead}, **{label(c): r.get(c, "") for c in cols}} for r in t]
    return table(named, lead + [label(c) for c in cols])


def staging_rows(rows: Rows) -> Rows:
    """Staging rows, api ``stage`` and ``stage_many``. Files from before numpy was the only copy
    measured ``stage_many`` with numpy's copy under the api name ``stage_many_numpy``; those rows
    count as ``stage_many`` where the file has no ``stage_many`` row of numpy's copy."""
    rows = [r for r in rows if r.get("kind") == "staging" and r.get("copy", "numpy") == "numpy"]

    def key(r):
        return (r["placement"], r["metric"], r["n_traces"], r["trace_tokens"])

    have = {key(r) for r in rows if r["api"] == "stage_many"}
    return [r for r in rows if r["api"] != "stage_many_numpy"] + [
        dict(r, api="stage_many") for r in rows if r["api"] == "stage_many_numpy" and key(r) not in have
    ]


def pct(x) -> str:
    return f"{x:.0%}" if isinstance(x, float) else ""


# -- one short section per bench ------------------------------------------------------------------
def launch_section(rows: Rows) -> list[str]:
    return [
        "host us per replay step (1024 slots x 8K tokens), by way of launching.",
        pivot_table(
            rows,
            lambda r: {"provider": r["provider"], "placement": r["placement"]},
            lambda r: r["batch"],
            us,
            ["provider", "placement"],
            lambda b: f"B={b}",
        ),
    ]


def staging_section(rows: Rows) -> list[str]:
    ceilings = {r["ceiling"]: r["gbps_p50"] for r in rows if r.get("kind") == "ceiling"}
    at = [
        r
        for r in staging_rows(rows)
        if r["n_traces"] == 64 and r["trace_tokens"] == 8192 and r["metric"] != "commit_host"
    ]
    return [
        "64 new traces of 8K tokens in one step: GB/s (share of the matching ceiling; target 70%)."
        " Ceilings, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()) + ".",
        pivot_table(
            at,
            lambda r: {"placement": r["placement"], "api": r["api"]},
            lambda r: r["metric"],
            lambda r: f"{r['gbps_p50']:.2f} ({pct(r.get('fraction_of_ceiling'))})",
            ["placement", "api"],
        ),
    ]


def placement_section(rows: Rows) -> list[str]:
    timing = [r for r in rows if r.get("kind") == "timing" and r.get("provider") == "kernel_device"]
    return [
        "replay kernel device us by trace length and table placement.",
        pivot_table(
            [r for r in timing if r["batch"] in (1, 4096)],
            lambda r: {"trace_tokens": r["trace_tokens"]},
            lambda r: (r["placement"], r["batch"]),
            us,
            ["trace_tokens"],
            lambda key: f"{key[0]} B={key[1]}",
        ),
    ]


def scaling_section(rows: Rows) -> list[str]:
    timing = [r for r in rows if r.get("kind") == "timing" and r.get("placement") == "device"]
    return [
        "us per replay step by batch, device placement (4096 slots x 8K tokens); jax_jit: what"
        " replay adds to a fori_loop step.",
        pivot_table(
            timing,
            lambda r: {"batch": r["batch"]},
            lambda r: r["provider"],
            us,
            ["batch"],
        ),
    ]


def logprob_section(rows: Rows) -> list[str]:
    copy = next((r for r in rows if r.get("provider") == "d2d_copy"), None)
    providers = (
        "trace_replay",
        "trace_replay_topk20",
        "trace_replay_argmax",
        "trace_replay_entropy",
        "torch",
        "torch_argmax",
    )
    timed = [
        r for r in rows if r.get("timing") == QUEUED and r.get("provider") in providers and r.get("vocab") == 151_936
    ]
    head = "logprob and rank over [B, 151,936] logits, device us per call (queued, host hidden)"
    if copy:
        head += f"; device copy {copy['gbps']:.0f} GB/s (read + write)"
    targets = [r for r in rows if r.get("provider") == "target"]
    return [
        head + ".",
        pivot_table(
            timed,
            lambda r: {"provider": r["provider"], "dtype": r["dtype"]},
            lambda r: r["batch"],
            us,
            ["provider", "dtype"],
            lambda b: f"B={b}",
        ),
        "",
        "Targets: "
        + "; ".join(
            f"{r['dtype']} B={r['batch']} {r['field']} {r['value']:.2f} (limit {r['limit']:g}, "
            f"{'met' if r['met'] else 'not met'})"
            for r in targets
        )
        + ".",
    ]


def jax_step_section(rows: Rows) -> list[str]:
    mechanisms = list(dict.fromkeys(r["mechanism"] for r in rows))
    modes = ("dispatch", "loop", "dispatch_device", "eager_host")
    found = {
        (r["mechanism"], r["mode"]): r
        for r in rows
        if r.get("config") == "default" and r.get("process", "main") == "main" and "us_p50" in r
    }
    # jax_triton from its own process, compared with that process's baseline
    found.update({(r["mechanism"], r["mode"]): r for r in rows if r["mechanism"] == "jax_triton" and "us_p50" in r})

    def cell(r: dict | None, mode: str) -> str:
        if r is None:
            return ""
        if mode == "eager_host":
            return us(r)
        added = r.get("added_us_p50")
        return f"{r['us_p50']:.1f} ({added:+.1f})" if added is not None else us(r)

    t = [
        {"mechanism": m, **{mode: cell(found.get((m, mode)), mode) for mode in modes}}
        for m in mechanisms
        if any((m, mode) in found for mode in modes)
    ]
    missing = [m for m in ("trace_replay_jax_kernel",) if m not in mechanisms]
    note = f" Not in this file yet: {', '.join(missing)}." if missing else ""
    return [
        "a jitted decode step (B=256, 8 bf16 matmuls, 32,000 logits), default XLA flags: us per step"
        " (added over the step without replay); eager_host: host us per eager replay call." + note,
        table(t, ["mechanism", *modes]),
    ]


def cli_run_section(rows: Rows) -> list[str]:
    reproduced = all(r.get("all_traces_reproduced") for r in rows)
    return [
        "`trace-replay run --device cuda`, GPT-2 loops: tokens per second, loop (end to end);"
        f" every trace reproduced: {reproduced}.",
        pivot_table(
            rows,
            lambda r: {"model": r["model"], "max_batch": r["max_batch"]},
            lambda r: r["framework"],
            lambda r: f"{r['loop_tokens_per_s_p50']:.0f} ({r['end_to_end_tokens_per_s_p50']:.0f})",
            ["model", "max_batch"],
        ),
    ]


def models_section(rows: Rows) -> list[str]:
    """One row per provider, one column per batch of the Qwen shape, then the other shapes' columns
    (rows from before ``shape`` existed count as the Qwen shape)."""

    def column(r):
        shape = r.get("shape", "qwen2.5-0.5b")
        return (shape != "qwen2.5-0.5b", shape, r["batch"])

    def cell(r):
        x = r.get("x_floor")
        return f"{r['decode_ms_per_step']:.2f}" + (f" ({x:.1f}x)" if isinstance(x, float) else "")

    shares = [r["replay_logprob_share"] for r in rows if isinstance(r.get("replay_logprob_share"), float)]
    share = f"{min(shares):.1%}-{max(shares):.1%}" if shares else "not measured"
    dates = sorted({str(r.get("date", ""))[:10] for r in rows})
    runs = f" Rows measured {dates[0]} to {dates[-1]}; the machine is the first row's." if len(dates) > 1 else ""
    return [
        "decode ms per step by batch, bf16, Qwen2.5-0.5B shape (other shapes named), in brackets times the"
        f" memory floor; replay + logprob/rank add {share} of our loops' steps.{runs} Plot: `results/models.svg`"
        " (`models_plot.py`).",
        pivot_table(
            rows,
            lambda r: {"provider": r.get("provider_id", r["provider"])},
            column,
            cell,
            ["provider"],
            lambda c: f"{c[1] + ' ' if c[0] else ''}B={c[2]}",
        ),
    ]


def score_section(rows: Rows) -> list[str]:
    t = [
        dict(
            r,
            provider=r["provider"],
            ms=f"{r['ms']:.1f}",
            peak_gib="n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
            x_floor="n/a" if not r.get("floor_ms") else f"{r['ms'] / r['floor_ms']:.2f}",
            logprob=pct(r.get("logprob_share")),
        )
        for r in rows
    ]
    return [
        "teacher-forced scoring of batch x 1,024 tokens, a Qwen2.5-0.5B-shaped model in bf16: ms per batch,"
        " peak device memory, times the matrix-product floor; logprob: the logprob op's share.",
        table(t, ["provider", "batch", "ms", "peak_gib", "x_floor", "logprob"]),
    ]


def backward_section(rows: Rows) -> list[str]:
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        column = f"{'bf16' if r['dtype'] == 'bfloat16' else 'fp32'} B={r['batch']}"
        row = cells.setdefault(r["provider"], {"provider": r["provider"]})
        row[column] = f"{r['us_p50']:.1f} ({r['x_floor']:.2f}x)"
    columns = ["provider", "bf16 B=256", "bf16 B=4096", "fp32 B=256", "fp32 B=4096"]
    return [
        "the gradient of the logprobs with respect to [B, 151,936] logits, backward only: device us (p50, "
        "do_bench) and, in brackets, times the floor of reading the logits and writing the gradient once at "
        "the measured copy rate (target 1.25).",
        table(list(cells.values()), columns),
    ]


SECTIONS = (
    ("launch", "launch.py", launch_section),
    ("staging", "staging.py", staging_section),
    ("placement", "placement.py", placement_section),
    ("scaling", "scaling.py", scaling_section),
    ("logprob_rank", "logprob_rank.py", logprob_section),
    ("jax_step", "jax_step.py", jax_step_section),
    ("cli_run", "cli_run.py", cli_run_section),
    ("models", "models.py", models_section),
    ("score", "score.py", score_section),
    ("logprob_backward", "logprob_backward.py", backward_section),
)


def figures(results: str) -> str:
    """The README's figures section, from the results files in ``results``."""
    parts = ["Generated by `python bench/summary.py` from `bench/results/*.json`; do not edit by hand.", ""]
    for name, script, section in SECTIONS:
        rows = load(results, name)
        if not rows:
            parts += [f"**{script}**: `results/{name}.json` not there yet.", ""]
            continue
        what, *body = section(rows)
        parts += [f"**{script}**: {what} _{machine(rows)}._", "", *body, ""]
    return "\n".join(parts).rstrip() + "\n"


def full_tables(results: str) -> str:
    """Every timing row of every results file, one table per file."""
    parts = ["## Full tables", ""]
    columns = {
        "launch": ["provider", "placement", "batch", "us_p50", "us_p20", "us_p80"],
        "staging": ["kind", "placement", "api", "metric", "ceiling", "n_traces", "trace_tokens", "us_p50", "gbps_p50"],
        "placement": ["kind", "provider", "placement", "trace_tokens", "batch", "us_p50", "us_p20", "us_p80"],
        "scaling": ["kind", "provider", "placement", "batch", "us_p50", "us_p20", "us_p80", "kernel_over_floor"],
        "logprob_rank": ["provider", "timing", "dtype", "batch", "vocab", "us_p50", "us_p20", "us_p80", "gbps"],
        "jax_step": ["config", "process", "mechanism", "mode", "us_p50", "us_p20", "us_p80", "added_us_p50"],
        "models": ["shape", "provider_id", "batch", "decode_ms_per_step", "floor_ms", "x_floor", "prefill_tokens_per_s"]
        + ["x_generate_static", "x_generate_dynamic", "replay_logprob_share", "traces_reproduced", "date"],
    }
    for name, cols in columns.items():
        rows = load(results, name)
        if rows:
            parts += [f"### {name}.json", "", table(rows, cols), ""]
    return "\n".join(parts)


def splice(text: str, section: str) -> str:
    """``text`` with what lies between the markers replaced by ``section``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN} ... {END} not found in order")
    return text[: start + len(BEGIN)] + "\n" + section + text[end:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default=RESULTS_DIR, help="folder of the results files")
    parser.add_argument("--readme", default=README, help="file whose figures section is rewritten")
    args = parse_args(__doc__, parser)
    section = figures(args.results)
    with open(args.readme) as f:
        text = f.read()
    with open(args.readme, "w") as f:
        f.write(splice(text, section))
    out = os.path.join(args.results, "summary.md")
    with open(out, "w") as f:
        f.write("# Benchmark figures\n\n" + section + "\n" + full_tables(args.results))
    print(f"wrote {args.readme} (figures) and {out}")


if __name__ == "__main__":
    main()
