"""`plan()` and `parallelize()`: the whole pipeline as a short sequence of stage calls."""

from __future__ import annotations

import time

import torch

from autotp.capture import capture, example_specs, inputs_from_specs
from autotp.cost.profile import load_profile
from autotp.graph import build_opgraph
from autotp.lower import lower
from autotp.mesh import Mesh
from autotp.runtime.groups import mesh_groups
from autotp.solve.assemble import assemble_plan
from autotp.solve.constraints import apply_constraints
from autotp.solve.ilp import solve
from autotp.solve.plan import Plan
from autotp.solve.problem import build_problem
from autotp.strategies import default_registry, enumerate_strategies

DEFAULT_PROFILE = "h100-hgx"


def as_mesh(mesh) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh(mesh)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def plan(model, mesh, example_inputs=(), example_kwargs=None, *, training: bool = True,
         profile=DEFAULT_PROFILE, pin: dict | None = None, allow=None, registry=None,
         time_limit_s: float | None = None) -> Plan:
    """Choose a placement for every parameter and op of ``model`` on ``mesh``.

    ``pin`` fixes parameter placements (``{"fc1.weight": ("S(0)",)}``) and lets
    the ILP choose the rest; ``allow(op, strategy)`` keeps only some strategies
    (see ``autotp.solve.constraints``). Nothing is allocated: ``model`` and the
    inputs may live on the ``meta`` device.
    """
    started = time.perf_counter()
    mesh, profile = as_mesh(mesh), load_profile(profile)
    example_inputs = _as_tuple(example_inputs)
    gm = capture(model, example_inputs, example_kwargs)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    wants_grad = {n: bool(x.requires_grad) for n, x in zip(names, example_inputs)}
    graph = build_opgraph(gm, wants_grad)
    strategies = enumerate_strategies(graph, mesh.shape, registry or default_registry())
    apply_constraints(graph, strategies, pin, allow)
    problem = build_problem(graph, strategies, mesh, profile, training)
    solution = solve(problem, time_limit_s)
    result = assemble_plan(graph, problem, solution, mesh, profile, training,
                           list(zip(names, example_specs(example_inputs))), wants_grad)
    result.stats = {"plan_s": time.perf_counter() - started, "solve_s": solution.solve_s}
    return result


def parallelize(model, plan: Plan, rank: int | None = None, groups=None) -> torch.fx.GraphModule:
    """This rank's program for ``plan``: a GraphModule with sharded parameters and collectives.

    Call it on every rank of an initialised process group whose size is the
    mesh's. Each rank then calls the result with the same full inputs.
    """
    import torch.distributed as dist

    groups = mesh_groups(plan.mesh) if groups is None else groups
    rank = dist.get_rank() if rank is None else rank
    inputs = inputs_from_specs(plan.inputs, device=_device_of(model))
    gm = capture(model, inputs)
    return lower(gm, plan, rank, groups)


def _device_of(model) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
