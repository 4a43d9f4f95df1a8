"""Plan a transformers model at scale, then run the same placements on 4 CPU processes.

``python examples/llama.py`` (or gpt2.py, bert.py, vit.py) calls `main` here:

1. plan the family at a size worth splitting, on the meta device, under the
   shipped H100 profile, and print the plan;
2. replay that plan (every op's strategy) on a small model of the same family, run it on 4 gloo
   processes, and print the max error of the outputs and of every gradient
   against the single-device model.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import hf_models  # noqa: E402
from autotp.runtime import spawn  # noqa: E402
from autotp.solve.constraints import same_as  # noqa: E402
from autotp.runtime.verify import max_errors  # noqa: E402

MESH = autotp.Mesh("4")


def _run(rank, world, name, plan):
    model, args, kwargs = hf_models.build_small(name)
    return max_errors(model, plan, args, rank, kwargs=kwargs)


def main(name: str) -> None:
    started = time.perf_counter()
    large, args, kwargs = hf_models.build_large(name)
    plan = autotp.plan(large, MESH, args, kwargs)
    print(plan.summary())
    print(f"\nplanned {type(large).__name__} ({plan.ilp['ops']} ops) in {plan.stats['plan_s']:.1f} s\n")
    small, s_args, s_kwargs = hf_models.build_small(name)
    small_plan = autotp.plan(small, MESH, s_args, s_kwargs, allow=same_as(plan))
    errors = spawn(_run, MESH.size, name, small_plan)
    out = max(e["output"] for e in errors)
    grad = max(e["gradient"] for e in errors)
    print(f"{name} on {MESH.size} gloo processes: max output error {out:.2e}, max gradient error {grad:.2e} "
          f"({errors[0]['parameters']} parameters) in {time.perf_counter() - started:.0f} s")
    if out > 1e-5 or grad > 1e-5:
        raise SystemExit(f"{name}: the parallel model does not match the single-device model")
