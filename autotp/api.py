"""`plan()` and `parallelize()`: the whole pipeline as a short sequence of stage calls."""

from __future__ import annotations

import time

import torch
from torch.utils import _pytree as pytree

from autotp.capture import capture, example_specs, inputs_from_specs
from autotp.cost.memory import TERMS, memory_by_term
from autotp.cost.profile import load_profile
from autotp.errors import MemoryLimitError
from autotp.graph import build_opgraph
from autotp.lower import lower
from autotp.materialize import check_materialized, prepare_weights
from autotp.mesh import Mesh
from autotp.progress import Stages, stages_or_silent
from autotp.report.scopes import node_scopes
from autotp.runtime.groups import mesh_groups
from autotp.solve.assemble import assemble_plan, chosen_strategies
from autotp.solve.constraints import apply_constraints
from autotp.solve.backends import resolve as resolve_solver
from autotp.solve.ilp import MemoryInfeasible, solve
from autotp.solve.plan import Plan
from autotp.solve.problem import build_problem
from autotp.strategies import default_registry, enumerate_strategies
from autotp.strategies.enumerate import prune_unreachable
from autotp.units import format_bytes, parse_bytes

DEFAULT_PROFILE = "h100-hgx"


def as_mesh(mesh) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh(mesh)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def plan(model, mesh, example_inputs=(), example_kwargs=None, *, training: bool = True,
         profile=DEFAULT_PROFILE, pin: dict | None = None, allow=None, registry=None,
         time_limit_s: float | None = None, memory_limit=None, overlap_gradients: bool = False,
         share_layers: bool = True, solver: str = "auto", replay_layers: bool = True,
         progress: Stages | None = None) -> Plan:
    """Choose a placement for every parameter and op of ``model`` on ``mesh``.

    ``pin`` fixes parameter placements (``{"fc1.weight": ("S(0)",)}``) and lets
    the ILP choose the rest; ``allow(op, strategy)`` keeps only some strategies
    (see ``autotp.solve.constraints``). Nothing is allocated: ``model`` and the
    inputs may live on the ``meta`` device. ``memory_limit`` (``"80GB"`` or
    bytes) bounds the predicted memory per device (parameters, gradients, Adam
    state and saved activations); when nothing fits, `MemoryLimitError` says
    the least any plan needs and which term dominates it.
    ``overlap_gradients=True`` lets the reduction of parameter gradients hide
    behind the backward compute, as DDP's bucketed all-reduce does (off by
    default: see docs/cost-model.md). ``progress`` (an `autotp.progress.Stages`)
    reports each stage and its time on stderr; by default nothing is printed.
    ``share_layers`` gives identical layers one choice in the ILP, so solve time
    stays flat as depth grows (see `autotp.solve.layers`). ``solver`` is
    ``"auto"`` (HiGHS under a memory limit when highspy is installed, else
    CBC; after dead-end elimination the two are about equally fast), ``"cbc"``
    or ``"highs"``.
    ``replay_layers`` traces the first few of a deep stack of identical layers
    and copies the last for the rest, after checking that they repeat
    (`autotp.capture.replay`; the plan records it, so `parallelize` captures alike).
    """
    started, stages = time.perf_counter(), stages_or_silent(progress)
    mesh, profile = as_mesh(mesh), load_profile(profile)
    example_inputs, example_kwargs = _as_tuple(example_inputs), dict(example_kwargs or {})
    with stages.stage("capturing") as stage:
        gm = capture(model, example_inputs, example_kwargs, replay_layers=replay_layers)
        graph = build_opgraph(gm, _placeholder_grads(gm, example_inputs, example_kwargs))
        stage.detail = f"{len(graph):,} ops{_replay_detail(gm)}"
    with stages.stage("enumerating strategies") as stage:
        strategies = enumerate_strategies(graph, mesh.shape, registry or default_registry())
        apply_constraints(graph, strategies, pin, allow)
        prune_unreachable(graph, strategies)
        stage.detail = f"{sum(len(s) for s in strategies.by_node.values()):,} strategies"
    with stages.stage("costing"):
        problem = build_problem(graph, strategies, mesh, profile, training, overlap_gradients, share_layers)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    with stages.stage("solving ILP") as stage:
        try:
            solution = solve(problem, time_limit_s, limit, solver)
        except MemoryInfeasible as exc:
            raise memory_limit_error(graph, problem, exc.smallest, mesh, training, limit) from None
        stage.detail = f"{solution.variables:,} variables"
    specs = example_specs(example_inputs, example_kwargs)
    specs["replay_layers"] = replay_layers
    result = assemble_plan(graph, problem, solution, mesh, profile, training, specs)
    result.scopes = node_scopes(gm)
    result.stats = {"plan_s": time.perf_counter() - started, "solve_s": solution.solve_s,
                    "stages_s": dict(stages.times), "solver": resolve_solver(solver, limit is not None),
                    "gap": solution.gap or 0.0,  # > 0 only when time_limit_s stopped the solver early
                    "capture": gm.meta["autotp_capture"]}
    return result


def _replay_detail(gm) -> str:
    """`` (76 layers replayed)`` or `` (traced in full: <why>)`` for the capture stage's progress line."""
    report = gm.meta["autotp_capture"]
    if report["replayed"]:
        return f" ({sum(report['replayed'].values())} layers replayed)"
    return f" (traced in full: {report['traced_in_full']})" if report["traced_in_full"] else ""


def replays_layers(plan: Plan) -> bool:
    """Whether ``plan`` was captured with layer replay; plans saved before it existed were not."""
    return bool(plan.inputs.get("replay_layers", False))


_HINTS = {
    "parameters": "split the model over more devices (a larger tensor-parallel axis)",
    "gradients": "split the model over more devices (a larger tensor-parallel axis)",
    "optimizer": "split the model over more devices; optimizer-state sharding is not supported yet",
    "activations": "use a smaller batch or sequence per step",
    "buffers": "split the model over more devices",
}


def memory_limit_error(graph, problem, smallest, mesh, training, limit) -> MemoryLimitError:
    """The error for a limit no plan meets: the least memory any plan needs, and its largest term."""
    terms = memory_by_term(graph, chosen_strategies(problem, smallest), mesh, training)
    dominant = max(TERMS, key=lambda t: terms[t])
    return MemoryLimitError(
        f"no plan fits {format_bytes(limit)} per device on {mesh}: the smallest any plan reaches is "
        f"{format_bytes(terms['total'])}, of which {dominant} {format_bytes(terms[dominant])}; "
        f"raise memory_limit or {_HINTS[dominant]}")


def _placeholder_grads(gm, args: tuple, kwargs: dict) -> dict[str, bool]:
    """Which graph inputs want gradients: export makes one placeholder per leaf of ``(args, kwargs)``."""
    leaves = pytree.tree_leaves((args, kwargs))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return {name: isinstance(leaf, torch.Tensor) and leaf.requires_grad for name, leaf in zip(names, leaves)}


def parallelize(model, plan: Plan, rank: int | None = None, groups=None, *, batch_collectives: bool = True,
                overlap: bool = True, counter=None, weights=None, device=None) -> torch.fx.GraphModule:
    """This rank's program for ``plan``: a GraphModule with sharded parameters and collectives.

    Call it on every rank of an initialised process group whose size is the
    mesh's. Each rank then calls the result with the same full inputs.
    ``batch_collectives`` merges independent collectives of one kind and axis
    into one, ``overlap`` starts each collective as soon as its input exists
    and waits just before its first use (both exact; see docs/benchmarks.md).
    ``counter`` (an `autotp.lower.collectives.CommCounter`) records every collective issued.
    ``weights`` (an `autotp.materialize` source) supplies this rank's shards, so
    ``model`` may live on ``meta``; they are placed on ``device`` (default CPU).
    """
    import torch.distributed as dist

    groups = mesh_groups(plan.mesh) if groups is None else groups
    rank = dist.get_rank() if rank is None else rank
    args, kwargs = inputs_from_specs(plan.inputs, device=_device_of(model))
    gm = capture(model, args, kwargs, replay_layers=replays_layers(plan))
    loader = prepare_weights(gm, weights, plan.mesh.shape, device) if weights is not None else None
    local = lower(gm, plan, rank, groups, batch=batch_collectives, overlap=overlap, counter=counter,
                  load_shard=loader)
    if weights is not None:
        check_materialized(local)
    return local


def _device_of(model) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
