"""Plan each transformers family at scale on the meta device and print a table.

Per model: ops in the captured graph, planning time (capture to plan) and ILP
solve time, ops that fell back to replicated, forward and backward collectives
per layer, and predicted step time under the H100 profile.

Run: ``python benchmarks/transformers_plans.py [--mesh 4]``
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import autotp  # noqa: E402
import hf_models  # noqa: E402


def per_layer(plan, phase: str, layers: int) -> str:
    counts = Counter(c["kind"] for c in plan.collectives if c["phase"] == phase)
    return ", ".join(f"{k} {v / layers:g}" for k, v in sorted(counts.items())) or "none"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="4")
    mesh = autotp.Mesh(parser.parse_args(argv).mesh)
    print("| model | ops | plan s | solve s | fallbacks | forward / layer | backward / layer | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in hf_models.FAMILIES:
        model, args, kwargs = hf_models.build_large(name)
        plan = autotp.plan(model, mesh, args, kwargs)
        layers = hf_models.LARGE[name]["layers"]
        fallbacks = Counter(plan.nodes[n].op.split(".")[0] for n in plan.fallback_ops)
        print(f"| {type(model).__name__} | {plan.ilp['ops']} | {plan.stats['plan_s']:.2f} | "
              f"{plan.stats['solve_s']:.2f} | {', '.join(f'{k} x{v}' for k, v in sorted(fallbacks.items()))} | "
              f"{per_layer(plan, 'forward', layers)} | {per_layer(plan, 'backward', layers)} | "
              f"{plan.predicted['total_s'] * 1e3:.2f} |")
    print("\nCollectives per layer count the whole step divided by the layer count, so the embedding, the final "
          "norm, the LM head and the loss add a fraction to each.")


if __name__ == "__main__":
    main()
