"""Quickstart: plan an MLP and a GPT at scale on the meta device, then run them on 4 CPU processes.

1. ``autotp.plan`` picks a placement for every parameter and op of a large
   model built on the ``meta`` device (nothing allocated), under the shipped
   H100 profile, and prints the plan.
2. The same plan, op by op, is replayed on a small copy of the model, which runs on
   4 gloo processes; outputs and every gradient are compared with the
   single-device model.

Run: ``python examples/quickstart.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
from autotp.runtime import spawn  # noqa: E402
from autotp.solve.constraints import same_as  # noqa: E402
from autotp.runtime.verify import max_errors  # noqa: E402
from models import GPT, MLP  # noqa: E402

MESH = autotp.Mesh("4")


def large_and_small(name: str):
    """The model at a size worth splitting (on meta), and a small copy with the same parameter names."""
    if name == "mlp":
        with torch.device("meta"):
            large = MLP(4096, 16384)
        torch.manual_seed(0)
        return (large, (torch.empty(8, 512, 4096, device="meta"),)), (MLP(32, 128), (torch.randn(4, 4, 32),))
    with torch.device("meta"):
        large = GPT(vocab=32000, hidden=8192, heads=64, layers=2, seq=16)
    idx = torch.zeros(1, 16, dtype=torch.long, device="meta")
    torch.manual_seed(0)
    small = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    return (large, (idx, idx)), (small, (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))


def run_on_rank(rank, world, cases):
    """On each rank: the small model, the plan, and the errors against one device."""
    results = []
    for name, plan in cases:
        _, (model, inputs) = large_and_small(name)
        results.append((name, max_errors(model, plan, inputs, rank)))
    return results


def main() -> None:
    cases = []
    for name in ("mlp", "gpt"):
        (large, large_inputs), (small, small_inputs) = large_and_small(name)
        plan = autotp.plan(large, MESH, large_inputs)
        print(f"===== {name}: plan at scale ({plan.stats['plan_s']:.1f} s) =====")
        print(plan.summary(), "\n")
        small_plan = autotp.plan(small, MESH, small_inputs, allow=same_as(plan))
        cases.append((name, small_plan))
    print(f"running the small models on {MESH.size} gloo processes ...")
    results = spawn(run_on_rank, MESH.size, cases)
    for i, (name, _) in enumerate(cases):
        out = max(r[i][1]["output"] for r in results)
        grad = max(r[i][1]["gradient"] for r in results)
        print(f"{name}: max output error {out:.2e}, max gradient error {grad:.2e} "
              f"({results[0][i][1]['parameters']} parameters compared on every rank)")
        if out > 1e-5 or grad > 1e-5:
            raise SystemExit(f"{name}: the parallel model does not match the single-device model")


if __name__ == "__main__":
    main()
