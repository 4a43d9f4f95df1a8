"""autotp against the baselines of its own search space, predicted: a table of step times, one row per case.

The cases are tests/test_optimal.py's (the suite asserts autotp <= every
baseline on each); this prints the figures for docs/planning.md. Every plan
is made on the meta device with the shipped profiles.

Run: ``python benchmarks/baselines.py``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import autotp  # noqa: E402
from autotp.report.baselines import NAMES, baseline_plans  # noqa: E402
from test_optimal import CASES, _built, _name  # noqa: E402


def main(cases=CASES) -> None:
    print("| case | autotp | " + " | ".join(NAMES) + " | autotp / best | objective - total | plan s |")
    print("|---|---|" + "---|" * len(NAMES) + "---|---|---|")
    for spec, mesh, links, profile in cases:
        model, args, kwargs = _built(spec)
        mesh = autotp.Mesh(mesh, links=links)
        started = time.perf_counter()
        plan = autotp.plan(model, mesh, args, kwargs, profile=profile)
        seconds = time.perf_counter() - started
        baselines = {b.name: b.plan for b in baseline_plans(model, mesh, args, kwargs, profile=profile)}
        best = min(p.predicted["total_s"] for p in baselines.values() if p is not None)
        cells = [f"{p.predicted['total_s'] * 1e3:.3f} ms" if p is not None else "n/a" for p in baselines.values()]
        error = plan.predicted["objective_s"] - plan.predicted["total_s"]
        shape = "x".join(map(str, mesh.shape))
        print(f"| {_name((spec, shape, links, profile))} | {plan.predicted['total_s'] * 1e3:.3f} ms | "
              f"{' | '.join(cells)} | {plan.predicted['total_s'] / best:.3f} | {error:.1e} s | {seconds:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
