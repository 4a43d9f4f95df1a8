"""Planning time against depth: shared ILP variables keep the solve flat, layer replay keeps capture flat.

Llama-2-70B-shaped decoder layers (hidden 8192, GQA 64/8, FFN 28672, sequence
4096) on the meta device, from 4 to 96 layers, planned on mesh 8 with the
defaults (``share_layers`` and ``replay_layers`` on), with every layer traced
(``replay_layers=False``), and with a variable set per layer
(``share_layers=False``). Prints a markdown table and writes two SVG plots:
solve time and whole-plan time against depth.

Run: ``python benchmarks/layer_scaling.py [--layers 4,8,16,32,64,96] [--unshared-up-to 32]
[--full-trace-up-to 96] [--svg docs/img/layer_scaling.svg] [--plan-svg docs/img/plan_scaling.svg]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402


SETTINGS = {  # (share_layers, replay_layers) -> label and colour in the plots
    (True, True): ("defaults: shared layers, replayed capture", "#1f77b4"),
    (True, False): ("every layer traced", "#2ca02c"),
    (False, True): ("one variable set per layer", "#d62728"),
}


def measure(layers: int, share: bool, replay: bool, mesh: str, solver: str) -> dict:
    model, args, kwargs = shapes.llama2_70b(layers=layers)
    plan = autotp.plan(model, mesh, args, kwargs, share_layers=share, replay_layers=replay, solver=solver,
                       memory_limit=None)
    return {"layers": layers, "setting": (share, replay), "ops": plan.ilp["ops"], "groups": plan.ilp["groups"],
            "variables": plan.ilp["variables"], "capture_s": plan.stats["stages_s"]["capturing"],
            "solve_s": plan.stats["solve_s"], "plan_s": plan.stats["plan_s"],
            "objective_ms": plan.predicted["objective_s"] * 1e3}


def svg_plot(rows: list[dict], path: Path, metric: str, label: str) -> None:
    """``metric`` seconds against layers, one polyline per setting; plain SVG, no plotting library."""
    width, height, pad = 560, 320, 50
    xmax = max(r["layers"] for r in rows)
    ymax = max(r[metric] for r in rows) * 1.1 or 1.0
    x = lambda v: pad + (width - 2 * pad) * v / xmax  # noqa: E731
    y = lambda v: height - pad - (height - 2 * pad) * v / ymax  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">decoder layers</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             f'{label} (s)</text>']
    for layers in sorted({r["layers"] for r in rows}):
        parts.append(f'<text x="{x(layers)}" y="{height - pad + 16}" text-anchor="middle">{layers}</text>')
    decimals = 1 if ymax >= 1 else 2 if ymax >= 0.1 else 3  # three ticks alike, at any scale of seconds
    for tick in (0, ymax / 2, ymax):
        parts.append(f'<text x="{pad - 6}" y="{y(tick) + 4}" text-anchor="end">{tick:.{decimals}f}</text>')
    for row, (setting, (name, colour)) in enumerate(SETTINGS.items()):
        points = sorted((r["layers"], r[metric]) for r in rows if r["setting"] == setting)
        if not points:
            continue
        coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in points)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{colour}"/>' for a, b in points]
        parts.append(f'<text x="{pad + 10}" y="{16 + 14 * row}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="4,8,16,32,64,96")
    parser.add_argument("--unshared-up-to", type=int, default=32)
    parser.add_argument("--full-trace-up-to", type=int, default=96)
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--svg", type=Path, default=None, help="plot of solve time against depth")
    parser.add_argument("--plan-svg", type=Path, default=None, help="plot of whole-plan time against depth")
    args = parser.parse_args(argv)
    rows = []
    print("| layers | share_layers | replay_layers | ops | ILP groups | variables | capture s | solve s | "
          "plan s | objective ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layers in (int(v) for v in args.layers.split(",")):
        for share, replay in SETTINGS:
            if (not share and layers > args.unshared_up_to) or (not replay and layers > args.full_trace_up_to):
                continue
            r = measure(layers, share, replay, args.mesh, args.solver)
            rows.append(r)
            print(f"| {layers} | {share} | {replay} | {r['ops']:,} | {r['groups']:,} | {r['variables']:,} | "
                  f"{r['capture_s']:.1f} | {r['solve_s']:.2f} | {r['plan_s']:.1f} | {r['objective_ms']:.2f} |",
                  flush=True)
    for path, metric, label in ((args.svg, "solve_s", "ILP solve"), (args.plan_svg, "plan_s", "whole plan")):
        if path:
            svg_plot(rows, path, metric, label)
            print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
