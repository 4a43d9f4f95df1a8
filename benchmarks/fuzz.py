"""Fuzz exactness: random models, the ILP's plan and random forced plans, on meshes 2, 3 and 4.

Each case is checked on real gloo processes: outputs and every parameter
gradient against the single-device model. A failing case prints a reproducer:
``tests/fuzz_models.py`` ``build(seed)`` with the mesh and the plan kind.

Run: ``python benchmarks/fuzz.py [--cases 200] [--first-seed 0] [--meshes 2,3,4]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1] / "tests")]

import autotp  # noqa: E402
from autotp.runtime import spawn  # noqa: E402
from autotp.runtime.verify import max_errors  # noqa: E402
from conftest import compute_bound_profile  # noqa: E402
from fuzz_models import build, random_filter  # noqa: E402

TOLERANCE = 1e-5
MESHES = ("2", "3", "4")


def make_plan(seed: int, kind: str, mesh):
    model, inputs = build(seed)
    allow = random_filter(seed) if kind == "random" else None
    return autotp.plan(model, mesh, inputs, profile=compute_bound_profile(), allow=allow)


def _check(rank, world, cases):
    out = []
    for seed, kind, plan in cases:
        model, inputs = build(seed)
        try:
            out.append(max_errors(model, plan, inputs, rank))
        except Exception as exc:  # noqa: BLE001 - a crash is a failure to report, not to hide
            out.append({"output": float("inf"), "gradient": float("inf"), "error": repr(exc)[:300]})
    return out


def run_cases(seeds, mesh_shape: str):
    """Plan and check every seed on one mesh; returns (seed, kind, plan or error, errors)."""
    mesh = autotp.Mesh(mesh_shape)
    cases, failures = [], []
    for seed in seeds:
        for kind in ("ilp", "random"):
            try:
                cases.append((seed, kind, make_plan(seed, kind, mesh)))
            except Exception as exc:  # noqa: BLE001
                failures.append((seed, kind, f"planning failed: {exc!r}"[:300]))
    per_rank = spawn(_check, mesh.size, cases, timeout_s=1800)
    results = []
    for i, (seed, kind, plan) in enumerate(cases):
        worst = max((r[i] for r in per_rank), key=lambda e: max(e["output"], e["gradient"]))
        results.append((seed, kind, plan, worst))
    return results, failures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=200, help="checks in all: seeds x meshes x 2 plan kinds")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--meshes", default=",".join(MESHES), help="mesh shapes, comma-separated")
    args = parser.parse_args(argv)
    meshes = args.meshes.split(",")
    seeds = list(range(args.first_seed, args.first_seed + max(1, args.cases // (2 * len(meshes)))))
    started, total, bad, fallbacks = time.perf_counter(), 0, [], Counter()
    for mesh in meshes:
        results, failures = run_cases(seeds, mesh)
        bad += [(seed, kind, mesh, why) for seed, kind, why in failures]
        for seed, kind, plan, err in results:
            total += 1
            fallbacks.update(plan.fallback_ops.values())
            if err["output"] > TOLERANCE or err["gradient"] > TOLERANCE:
                bad.append((seed, kind, mesh, err))
        total += len(failures)
        print(f"mesh {mesh}: {len(results) + len(failures)} cases, {len(failures)} planning failures", flush=True)
    print(f"\n{total} cases, {len(bad)} failures, {time.perf_counter() - started:.0f} s")
    for seed, kind, mesh, why in bad:
        print(f"  FAIL seed={seed} plan={kind} mesh={mesh}: {why}  "
              f"(reproduce: tests/fuzz_models.build({seed}), benchmarks/fuzz.make_plan({seed}, {kind!r}, Mesh({mesh!r})))")
    print("\nops replicated for lack of a rule, with the reason:")
    for reason, n in fallbacks.most_common():
        print(f"  {n:5d}  {reason}")


if __name__ == "__main__":
    main()
