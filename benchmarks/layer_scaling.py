"""Planning time against depth: identical layers share ILP variables, so the solve stays flat.

Llama-2-70B-shaped decoder layers (hidden 8192, GQA 64/8, FFN 28672, sequence
4096) on the meta device, from 4 to 96 layers, planned on mesh 8 with and
without ``share_layers``. Prints a markdown table and writes an SVG plot.

Run: ``python benchmarks/layer_scaling.py [--layers 4,8,16,32,64,96] [--unshared-up-to 32] [--svg docs/img/layer_scaling.svg]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402


def measure(layers: int, share: bool, mesh: str, solver: str) -> dict:
    model, args, kwargs = shapes.llama2_70b(layers=layers)
    plan = autotp.plan(model, mesh, args, kwargs, share_layers=share, solver=solver)
    return {"layers": layers, "share": share, "ops": plan.ilp["ops"], "groups": plan.ilp["groups"],
            "variables": plan.ilp["variables"], "solve_s": plan.stats["solve_s"], "plan_s": plan.stats["plan_s"],
            "objective_ms": plan.predicted["objective_s"] * 1e3}


def svg_plot(rows: list[dict], path: Path) -> None:
    """Solve seconds against layers, one polyline per setting; plain SVG, no plotting library."""
    width, height, pad = 560, 320, 50
    xmax = max(r["layers"] for r in rows)
    ymax = max(r["solve_s"] for r in rows) * 1.1 or 1.0
    x = lambda v: pad + (width - 2 * pad) * v / xmax  # noqa: E731
    y = lambda v: height - pad - (height - 2 * pad) * v / ymax  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">decoder layers</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             f'ILP solve (s)</text>']
    for layers in sorted({r["layers"] for r in rows}):
        parts.append(f'<text x="{x(layers)}" y="{height - pad + 16}" text-anchor="middle">{layers}</text>')
    for tick in (0, ymax / 2, ymax):
        parts.append(f'<text x="{pad - 6}" y="{y(tick) + 4}" text-anchor="end">{tick:.1f}</text>')
    for share, colour, label in ((True, "#1f77b4", "shared layers"), (False, "#d62728", "one variable set per layer")):
        points = sorted((r["layers"], r["solve_s"]) for r in rows if r["share"] == share)
        if not points:
            continue
        coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in points)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{colour}"/>' for a, b in points]
        lx, ly = x(points[-1][0]) - 150, y(points[-1][1]) - 10
        parts.append(f'<text x="{lx:.1f}" y="{ly:.1f}" fill="{colour}">{label}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="4,8,16,32,64,96")
    parser.add_argument("--unshared-up-to", type=int, default=32)
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--svg", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print("| layers | share_layers | ops | ILP groups | variables | solve s | plan s (capture included) | objective ms |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in (int(v) for v in args.layers.split(",")):
        for share in (True, False):
            if not share and layers > args.unshared_up_to:
                continue
            r = measure(layers, share, args.mesh, args.solver)
            rows.append(r)
            print(f"| {layers} | {share} | {r['ops']:,} | {r['groups']:,} | {r['variables']:,} | "
                  f"{r['solve_s']:.2f} | {r['plan_s']:.1f} | {r['objective_ms']:.2f} |", flush=True)
    if args.svg:
        svg_plot(rows, args.svg)
        print(f"\nplot: {args.svg}")


if __name__ == "__main__":
    main()
