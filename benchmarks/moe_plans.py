"""Mixture of experts: Mixtral-8x7B on 8 H100, its experts split each way, costed in the same model.

Mixtral-8x7B (bf16 mixed-precision training, 32 layers, 8 experts of FFN
14336 with 2 per token, sequence 4096) on the meta device, planned under
`h100-hgx` on one node of 8 (NVLink). The experts op (`autotp.capture.experts`)
is held to one way of splitting at a time, the rest of the model planned by
the ILP around it:

* ``ilp``: the ILP's own choice;
* ``expert-parallel``: experts and tokens split, pairs routed by all-to-all;
* ``experts-split``: experts split, every device runs them for all tokens
  into a partial sum;
* ``tp-inside``: tensor parallelism inside each expert (its FFN split by
  columns and rows, Megatron's MLP), tokens whole, a partial sum;
* ``tokens-split``: every expert whole on every device, tokens split (data
  parallelism: each expert's gradient summed over all 8);
* ``replicated``: the experts run whole on every device.

Inside the experts, each device runs its columns of the gate and up halves
of transformers' ``gate_up_proj``, which stays whole (no even split keeps the
halves together; docs/concepts.md, Strategies), and its rows of ``down``.

Two tables. Mixtral-8x7B has 46.7 billion parameters: with Adam in mixed
precision (18 bytes each) no plan on 8 devices of 80 GB holds them, so the
first table plans without a memory limit and shows the memory each way
needs. The second trains in pure bf16 (8 bytes a parameter) under the
default limit (80 GB less 5%), the memory levers (ZeRO, recomputation,
micro-batches) free to make each way fit.

Run: ``python benchmarks/moe_plans.py [--layers N] [--batch B]`` (fewer layers: a quick check, as
tests/test_benchmarks.py does)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import autotp  # noqa: E402
import shapes  # noqa: E402
from autotp.capture.experts import EXPERTS  # noqa: E402
from autotp.errors import MemoryLimitError  # noqa: E402
from autotp.placement import Shard  # noqa: E402
from autotp.strategies.experts import EXPERT_COLUMNS, EXPERT_PARALLEL, TOKENS  # noqa: E402
from autotp.units import format_bytes  # noqa: E402


def _split(strategy, i: int) -> bool:
    return any(isinstance(p, Shard) for p in strategy.ins[i])


WAYS = {  # name -> which strategies of the experts op it keeps
    "ilp": lambda s: True,
    "expert-parallel": lambda s: s.impl == EXPERT_PARALLEL and _split(s, TOKENS),
    "experts-split": lambda s: s.impl == EXPERT_PARALLEL and not _split(s, TOKENS),
    "tp-inside": lambda s: s.impl == EXPERT_COLUMNS and not _split(s, TOKENS),
    "tokens-split": lambda s: s.impl is None and _split(s, TOKENS),
    "replicated": lambda s: s.impl is None and not _split(s, TOKENS),
}


def held(way: str):
    keep = WAYS[way]
    return lambda op, strategy: op.target != EXPERTS or keep(strategy)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch of sequences of 4096 tokens")
    options = parser.parse_args(argv)
    model, args, kwargs = shapes.mixtral_8x7b(layers=options.layers, batch=options.batch)
    mesh = autotp.Mesh("8", links="nvlink")
    for precision, limit in (("mixed", None), ("bf16", "auto")):
        print(f"\n### Mixtral-8x7B ({options.layers} layers), global batch {options.batch} x 4096, mesh {mesh}, "
              f"h100-hgx, {precision} precision, {'no memory limit' if limit is None else 'the default limit'}\n")
        print("| experts | step (ms) | compute | communication | all-to-all | memory / device | levers | planned in |")
        print("|---|---|---|---|---|---|---|---|")
        for way in WAYS:
            row(model, args, kwargs, mesh, way, precision, limit)


def row(model, args, kwargs, mesh, way: str, precision: str, limit) -> None:
    started = time.perf_counter()
    try:
        plan = autotp.plan(model, mesh, args, kwargs, profile="h100-hgx", memory_limit=limit, precision=precision,
                           allow=held(way))
    except MemoryLimitError as exc:
        print(f"| {way} | does not fit: {str(exc).split(';')[0]} | | | | | | {time.perf_counter() - started:.1f} s |")
        return
    p = plan.predicted
    routed = sum(c["time_s"] for c in plan.collectives if c["kind"] == "all_to_all")
    levers = [f"{plan.micro_batches} micro-batches"] if plan.micro_batches > 1 else []
    zero = len(plan.optimizer_sharding)
    levers += [f"ZeRO on {zero} parameter{'s' if zero > 1 else ''}"] if zero else []
    levers += [f"{len(plan.recompute)} layers recomputed"] if plan.recompute else []
    levers += [f"regathered: {', '.join(plan.regather)}"] if plan.regather else []
    print(f"| {way} | {p['total_s'] * 1e3:.1f} | {p['compute_s'] * 1e3:.1f} | {p['comm_s'] * 1e3:.1f} | "
          f"{routed * plan.micro_batches * 1e3:.1f} | {format_bytes(plan.memory['total'])} | "
          f"{', '.join(levers) or 'none'} | {time.perf_counter() - started:.1f} s |")


if __name__ == "__main__":
    main()
