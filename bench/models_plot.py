"""``bench/results/models.json``, the results file of ``models.py``: rows merged across runs, and
its figure drawn as a dependency-free SVG.

- :func:`merged` puts new rows into a file's rows (a new row replaces one of the same shape,
  provider and batch; each keeps its own provenance), :func:`relate` sets the speed-ups against
  ``generate``, :func:`save` writes the file (through a temporary file, so that a run stopped
  mid-write leaves the last complete one).
- ``python bench/models_plot.py [--results F] [--out F]`` draws ``bench/results/models.svg``:
  ms per decode step (log y) against batch (log x) for the torch loop, the JAX loop, ``generate``
  with a static cache and ``torch.compile`` (the strong peer) and the memory floor, Qwen2.5-0.5B
  shape only; the title names the GPU(s) and date(s) of the rows' provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from xml.sax.saxutils import escape

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ORDER = ("torch", "jax", "generate-static", "generate-dynamic")
SERIES = (  # provider id (None: the floor), legend, colour, dashes
    ("torch", "torch loop (CUDA-graph step)", "#1f77b4", ""),
    ("jax", "JAX loop (jitted step)", "#d62728", ""),
    ("generate-static", "generate, static cache + torch.compile", "#2ca02c", ""),
    (None, "memory floor (weights + KV / copy bandwidth)", "#555555", "6,4"),
)
W, H, LEFT, RIGHT, TOP, BOTTOM = 860, 480, 80, 300, 64, 64


def relate(rows: list[dict]) -> list[dict]:
    """Each row's ``x_generate_static`` / ``x_generate_dynamic``: the peer's ms/step over its own,
    at the same shape and batch (None without such a row)."""
    ms = {(r["shape"], r["provider_id"], r["batch"]): r["decode_ms_per_step"] for r in rows}
    for row in rows:
        for peer in ("generate-static", "generate-dynamic"):
            ref = ms.get((row["shape"], peer, row["batch"]))
            row["x_" + peer.replace("-", "_")] = ref / row["decode_ms_per_step"] if ref else None
    return rows


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` rows (of a results file) with ``new`` ones: a new row replaces an old one of the same
    shape, provider and batch; rows written before this format (no ``shape``) are dropped."""

    def key(r):
        return (r["shape"], r["provider_id"], r["batch"])

    def order(r):  # the Qwen shape first, then providers as models.py lists them, then batch
        return (r["shape"] != "qwen2.5-0.5b", r["shape"], rank.get(r["provider_id"], 9), r["batch"])

    fresh = {key(r) for r in new}
    kept = [r for r in old if "shape" in r and "provider_id" in r and key(r) not in fresh]
    rank = {p: i for i, p in enumerate(ORDER)}
    return relate(sorted(kept + new, key=order))


def save(path: str, old: list[dict], new: list[dict]) -> None:
    """Write ``merged(old, new)`` to ``path``."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(merged(old, new), f, indent=1)
    os.replace(tmp, path)


def _curves(rows: list[dict]) -> list[tuple[str, str, str, list[tuple[int, float]]]]:
    """``(legend, colour, dashes, [(batch, ms)])`` per series with points."""
    out = []
    for pid, legend, colour, dash in SERIES:
        points: dict[int, list[float]] = {}
        for r in rows:
            value = r.get("floor_ms") if pid is None else r.get("decode_ms_per_step")
            if (pid is None or r["provider_id"] == pid) and isinstance(value, float) and value > 0:
                points.setdefault(r["batch"], []).append(value)
        if points:  # the floor: the median over the rows of a batch (one per provider and run)
            out.append((legend, colour, dash, [(b, sorted(v)[len(v) // 2]) for b, v in sorted(points.items())]))
    return out


def _ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks covering ``[lo, hi]``."""
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0**e for m in (1, 2, 5) if lo <= m * 10.0**e <= hi]
    return ticks


def svg(rows: list[dict]) -> str:
    """The figure of the Qwen-shape ``rows`` as an SVG document."""
    rows = [r for r in rows if r.get("shape") == "qwen2.5-0.5b"]
    curves = _curves(rows)
    if not curves:
        raise ValueError("no Qwen2.5-0.5B rows with ms per step to draw")
    batches = sorted({b for *_, pts in curves for b, _ in pts})
    values = [v for *_, pts in curves for _, v in pts]
    x_lo, x_hi = math.log(batches[0] / 1.5), math.log(batches[-1] * 1.5)
    y_lo = 10.0 ** math.floor(math.log10(min(values)))
    y_hi = 10.0 ** math.ceil(math.log10(max(values)))
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(b):
        return LEFT + (math.log(b) - x_lo) / (x_hi - x_lo) * pw

    def y(v):
        return TOP + ph - (math.log(v) - math.log(y_lo)) / (math.log(y_hi) - math.log(y_lo)) * ph

    gpus = sorted({str(r.get("gpu")) for r in rows})
    dates = sorted({str(r.get("date", ""))[:10] for r in rows})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{LEFT}" y="24" font-size="15" font-weight="bold">Decode ms per step, Qwen2.5-0.5B shape, '
        "bf16: our loops, generate, the memory floor</text>",
        f'<text x="{LEFT}" y="44" fill="#444">{escape(", ".join(gpus))}, {escape(when)} (bench/models.py)</text>',
    ]
    for t in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for b in batches:
        out.append(f'<line x1="{x(b):.1f}" x2="{x(b):.1f}" y1="{TOP}" y2="{TOP + ph}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x(b):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{b}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 16}" text-anchor="middle">batch (requests decoding at once)</text>')
    out.append(
        f'<text transform="translate(22 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">ms per decode step</text>'
    )
    for i, (legend, colour, dash, pts) in enumerate(curves):
        path = " ".join(f"{x(b):.1f},{y(v):.1f}" for b, v in pts)
        style = f'stroke="{colour}" stroke-width="2" fill="none"' + (f' stroke-dasharray="{dash}"' if dash else "")
        out.append(f'<polyline points="{path}" {style}/>')
        if not dash:
            out += [f'<circle cx="{x(b):.1f}" cy="{y(v):.1f}" r="3.5" fill="{colour}"/>' for b, v in pts]
        ly = TOP + 12 + 22 * i
        out.append(f'<line x1="{W - RIGHT + 16}" x2="{W - RIGHT + 44}" y1="{ly}" y2="{ly}" {style}/>')
        out.append(f'<text x="{W - RIGHT + 50}" y="{ly + 4}">{escape(legend)}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(RESULTS, "models.json"), help="the rows (models.py's file)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "models.svg"), help="the SVG written")
    args = ap.parse_args()
    with open(args.results) as f:
        rows = json.load(f)
    text = svg(rows)
    with open(args.out, "w") as f:
        f.write(text)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
