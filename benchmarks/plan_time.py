"""How long planning takes, stage by stage (HiGHS by default; ``--solvers highs,cbc`` adds CBC).

Per model and mesh: capture (torch.export + operator graph), strategy
enumeration, costing (building the ILP's cost tables), ILP build (the model's arrays),
and the solve itself; then the ILP's size. Every row plans from scratch on
the meta device, without a memory limit (the 70B plans do not fit 80 GB with
Adam's state replicated: benchmarks/big_plans.py).

Run: ``python benchmarks/plan_time.py [--only gpt,llama8b,llama70b] [--solvers highs,cbc]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402
from autotp.solve.backends import highs_available  # noqa: E402
from models import GPT  # noqa: E402  (examples/ is on the path through shapes)

import torch  # noqa: E402


def gpt_test_model():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    return GPT(), (idx, idx), {}


CASES = {  # name -> (builder, mesh, links, profile)
    "gpt": (gpt_test_model, "4", None, "h100-hgx"),
    "gpt-2x2": (gpt_test_model, "2x2", None, "h100-hgx"),
    "llama8b": (lambda: shapes.llama3_8b(), "8", None, "h100-hgx"),
    "llama70b": (lambda: shapes.llama2_70b(), "8", None, "h100-hgx"),
    "llama70b-4x8": (lambda: shapes.llama2_70b(batch=4), "4x8", "ethernet,nvlink", "ethernet-2node"),
}


def row(name: str, solver: str) -> str:
    build, mesh, links, profile = CASES[name]
    model, args, kwargs = build()
    plan = autotp.plan(model, autotp.Mesh(mesh, links=links), args, kwargs, profile=profile, solver=solver,
                       memory_limit=None)
    st, ilp = plan.stats["stages_s"], plan.ilp
    ilp_build = st["solving ILP"] - plan.stats["solve_s"]
    return (f"| {name} | {mesh} | {solver} | {ilp['ops']:,} | {ilp['groups']:,} | {ilp['variables']:,} | "
            f"{ilp['constraints']:,} | {st['capturing']:.2f} | {st['enumerating strategies']:.2f} | "
            f"{st['costing']:.2f} | {ilp_build:.2f} | {plan.stats['solve_s']:.2f} | {plan.stats['plan_s']:.2f} | "
            f"{plan.predicted['objective_s'] * 1e3:.3f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--solvers", default="highs" if highs_available() else "cbc")
    args = parser.parse_args(argv)
    print("| model | mesh | solver | ops | groups | variables | constraints | capture s | strategies s | "
          "costing s | ILP build s | solve s | total s | objective ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.only.split(","):
        for solver in args.solvers.split(","):
            print(row(name, solver), flush=True)


if __name__ == "__main__":
    main()
