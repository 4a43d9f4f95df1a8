"""How well does the cost model predict? Collectives and whole plans, predicted against measured.

On this machine with 4 gloo processes, against a profile made by
``autotp calibrate --nproc 4``:

1. each collective at message sizes between the calibrated ones (fresh
   measurements, not the calibration's own), predicted vs measured time;
2. six plans of one GPT (autotp's, Megatron column/row, pure data parallel,
   all-replicated, row-only, column-only with gathers): predicted vs measured
   step time (forward + backward, median of 12 steps), and their Spearman rank
   correlation.

Run: ``python benchmarks/cost_fidelity.py --profile cpu-2core-4proc [--quick]``
(``--quick``: 2 processes, two message sizes, 3 repeats, 2 steps after 1
warm-up; a check that the script runs, as tests/test_benchmarks.py does; its
figures mean nothing)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import autotp  # noqa: E402
from autotp.calibrate.measure import COLLECTIVES, collective_time_s  # noqa: E402
from autotp.cost.comm import collective_time_s as predicted_s  # noqa: E402
from autotp.runtime import spawn  # noqa: E402
from autotp.solve.constraints import data_parallel_only, replicated_only  # noqa: E402
from models import GPT  # noqa: E402

WORLD = 4
SIZES = tuple(8192 * 4 ** i for i in range(7))  # 8 KiB .. 32 MiB: between the calibrated sizes
FULL = dict(world=WORLD, sizes=SIZES, repeats=15, steps=12, warmup=3)  # repeats: per collective; steps: per plan
QUICK = dict(world=2, sizes=SIZES[:2], repeats=3, steps=2, warmup=1)  # --quick


def _measure_collectives(rank, world, sizes, repeats):
    group = dist.group.WORLD
    return {(kind, n): collective_time_s(kind, n, world, group, torch.device("cpu"), repeats=repeats)
            for kind in COLLECTIVES for n in sizes}


def collective_table(profile, sizes=SIZES, repeats=FULL["repeats"], world=WORLD) -> list[tuple]:
    measured = spawn(_measure_collectives, world, sizes, repeats)[0]
    mesh = autotp.Mesh(world, links="loopback")
    rows = []
    for (kind, n), seconds in measured.items():
        rows.append((kind, n, predicted_s(kind, 0, n, mesh, profile), seconds))
    return rows


def make_gpt():
    torch.manual_seed(0)
    model = GPT(vocab=512, hidden=256, heads=8, layers=2, seq=64)
    return model, (torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64)))


def _pins(model, style: str) -> dict:
    pins = {}
    for name, _ in model.named_parameters():
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        is_linear = module in ("q", "k", "v", "proj", "up", "down", "head") and name.endswith("weight")
        if style == "megatron":
            p = "S(0)" if module in ("q", "k", "v", "up", "head") else "S(1)" if is_linear else "R"
        elif style == "row":
            p = "S(1)" if is_linear else "R"
        else:  # column
            p = "S(0)" if is_linear else "R"
        pins[name] = (p,)
    return pins


def batch_split(op, strategy) -> bool:
    """Data parallel for real: parameters whole, every op that can split its batch does."""
    if not data_parallel_only(op, strategy):
        return False
    return op.kind != "op" or not strategy.is_replicated


def linear_weights(layout: str):
    """Every linear must use its weight as stored (``S(1)`` row, ``S(0)`` column): no weight gathers."""

    def allow(op, strategy) -> bool:
        if op.op_name != "linear.default":
            return True
        return strategy.ins[1] == (autotp.Shard(int(layout[2])),)

    return allow


def plans(profile, world=WORLD) -> dict:
    model, inputs = make_gpt()
    mesh = autotp.Mesh(world, links="loopback")
    plan = lambda **kw: autotp.plan(model, mesh, inputs, profile=profile, **kw)  # noqa: E731
    return {
        "autotp": plan(),
        "megatron": plan(pin=_pins(model, "megatron"), allow=_megatron_linears),
        "data-parallel": plan(allow=batch_split),
        "replicated": plan(allow=replicated_only),
        "row-only": plan(pin=_pins(model, "row"), allow=linear_weights("S(1)")),
        "column-only": plan(pin=_pins(model, "column"), allow=linear_weights("S(0)")),
    }


def _megatron_linears(op, strategy) -> bool:
    """Column-parallel q/k/v/up/head and row-parallel proj/down, each using its weight as stored."""
    if op.op_name != "linear.default":
        return True
    weight = strategy.ins[1][0]
    return isinstance(weight, autotp.Shard)


def _measure_steps(rank, world, named_plans, steps=FULL["steps"], warmup=FULL["warmup"]):
    out = {}
    for name, plan in named_plans.items():
        model, inputs = make_gpt()
        local = autotp.parallelize(model, plan)
        samples = []
        for step in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            local(*inputs).backward()
            samples.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(samples[warmup:])], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = float(t)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation; tied values share their average rank."""

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="cpu-2core-4proc")
    parser.add_argument("--quick", action="store_true", help="2 processes, few sizes, repeats and steps: a check")
    args = parser.parse_args(argv)
    profile = autotp.load_profile(args.profile)
    scale = QUICK if args.quick else FULL

    rows = collective_table(profile, scale["sizes"], scale["repeats"], scale["world"])
    print(f"Collectives on {scale['world']} gloo processes, profile {profile.name}\n")
    print("| collective | message | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|")
    errors = []
    for kind, n, pred, meas in rows:
        err = (pred - meas) / meas
        errors.append(abs(err))
        print(f"| {kind} | {n >> 10} KiB | {pred * 1e3:.3f} | {meas * 1e3:.3f} | {err:+.0%} |")
    print(f"\nmedian absolute error: {statistics.median(errors):.1%} over {len(errors)} points\n")

    named = plans(profile, scale["world"])
    measured = spawn(_measure_steps, scale["world"], named, scale["steps"], scale["warmup"])[0]
    print("| plan | predicted ms | measured ms | forward collectives |")
    print("|---|---|---|---|")
    for name, plan in named.items():
        print(f"| {name} | {plan.predicted['total_s'] * 1e3:.2f} | {measured[name] * 1e3:.2f} | "
              f"{len(plan.forward_collectives())} |")
    names = list(named)
    rho = spearman([named[n].predicted["total_s"] for n in names], [measured[n] for n in names])
    best = min(measured.values())
    print(f"\nSpearman rank correlation: {rho:.3f}; autotp's plan measured {measured['autotp'] / best:.2f}x "
          f"the fastest")


if __name__ == "__main__":
    main()
