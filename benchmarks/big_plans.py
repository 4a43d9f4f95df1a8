"""Plan 70B- and 175B-parameter shapes on multi-node meshes, on the meta device, and print the plans.

- Llama-2-70B (80 layers, hidden 8192, GQA 64/8, FFN 28672, vocab 32000,
  sequence 4096) on mesh 8 (one HGX node) and on 4x8 (4 nodes: Ethernet
  between them, NVLink inside);
- GPT-3-175B (96 layers, hidden 12288) on 8x8 with an 80 GB limit per device.

Every plan prices data parallelism's gradient sums in buckets behind the
backward pass (the default) and counts memory as mixed-precision training
keeps it (18 bytes a parameter). The Llama plans are made without a memory
limit (``memory_limit=None``); ``--limit auto`` gives every case the default
limit (80 GB less 5%), under which the ILP may split optimizer state, recompute
layers and run micro-batches, or says why nothing fits (``MemoryLimitError``).

Per plan: the placement of each layer parameter on each axis (identical layers
folded into one row), the predicted step time split into compute and
communication, memory per device by term, and planning/solve times.

Run: ``python benchmarks/big_plans.py [--only 70b-8,70b-4x8,175b-8x8] [--solver auto|cbc|highs] [--limit auto]
[--layers N]`` (the last: N layers instead of the model's 80 or 96, a quick check that the script runs, as
tests/test_benchmarks.py does)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402
from autotp.report.collapse import collapse  # noqa: E402
from autotp.units import format_bytes  # noqa: E402

CASES = {  # name -> (builder, mesh, links, profile, memory limit); a builder takes layers=N or the model's own
    "70b-8": (lambda **kw: shapes.llama2_70b(batch=1, **kw), "8", None, "h100-hgx", None),
    "70b-4x8": (lambda **kw: shapes.llama2_70b(batch=4, **kw), "4x8", "ethernet,nvlink", "ethernet-2node", None),
    "175b-8x8": (lambda **kw: shapes.gpt3_175b(batch=8, **kw), "8x8", "ethernet,nvlink", "ethernet-2node", "80GB"),
}


def report(name: str, solver: str = "auto", limit=None, layers: int | None = None) -> None:
    build, mesh, links, profile, case_limit = CASES[name]
    limit = case_limit if limit is None else limit
    model, args, kwargs = build(**({} if layers is None else {"layers": layers}))
    mesh = autotp.Mesh(mesh, links=links)
    print(f"\n### {name}: {type(model).__name__}, {sum(t.numel() for t in model.parameters()) / 1e9:.1f} B "
          f"parameters, mesh {mesh} ({profile}), batch x seq {tuple(args[0].shape)}"
          + (f", memory limit {limit}" if limit else ""))
    try:
        plan = autotp.plan(model, mesh, args, kwargs, profile=profile, memory_limit=limit, solver=solver)
    except autotp.AutotpError as exc:
        print(f"\n{type(exc).__name__}: {exc}")
        return
    p, mem = plan.predicted, plan.memory
    print(f"\nplanned in {plan.stats['plan_s']:.1f} s (ILP solve {plan.stats['solve_s']:.2f} s with "
          f"{plan.stats['solver']}, "
          f"{plan.ilp['variables']:,} variables, {plan.ilp['ops']:,} ops, "
          f"{plan.ilp.get('shared_layers', 0)} layers sharing variables); fallbacks: {len(plan.fallback_ops)}")
    print(f"\npredicted step: {p['total_s'] * 1e3:.1f} ms = compute {p['compute_s'] * 1e3:.1f} ms + "
          f"communication {p['comm_s'] * 1e3:.1f} ms - {p['gradient_hidden_s'] * 1e3:.1f} ms of gradient sums "
          f"hidden behind the backward pass - {p['gather_hidden_s'] * 1e3:.1f} ms of ZeRO all-gathers hidden "
          f"behind the next forward - {p['overlap_hidden_s'] * 1e3:.1f} ms of tensor-parallel collectives "
          f"hidden behind their matmuls (ILP objective {p['objective_s'] * 1e3:.1f} ms)")
    print(f"\nmemory levers: {plan.micro_batches} micro-batch(es) a step, {len(plan.recompute)} layers recomputed, "
          f"optimizer state split for {len(plan.optimizer_sharding)} of {len(plan.parameters)} parameters, "
          f"gathered again in backward: {', '.join(plan.regather) or 'nothing'} "
          f"({p['regather_s'] * 1e3:.1f} ms of all-gathers)")
    print("\nmemory per device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items()))
    print(f"\n| parameter | {' | '.join(mesh.names)} | layers |")
    print("|---|" + "---|" * len(mesh.names) + "---|")
    for row in collapse(list(plan.parameters.items())):  # identical layers folded, as `autotp plan` does
        print(f"| {row.name} | {' | '.join(row.values)} | {row.count} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--solver", default="auto", choices=["auto", "cbc", "highs"])
    parser.add_argument("--limit", default=None, help="memory limit for every case, e.g. auto or 80GB")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (fewer: a quick check)")
    args = parser.parse_args(argv)
    for name in args.only.split(","):
        report(name, args.solver, args.limit, args.layers)


if __name__ == "__main__":
    main()
