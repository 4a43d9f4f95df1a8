"""Dead-end elimination (`autotp.solve.reduce`) shrinks the ILP of real models and never changes its optimum.

Both solvers reach the same objective with and without the reduction, from
fewer variables, free, under a binding memory limit, and minimising memory,
with every memory lever in the problem (optimizer state split, layers
recomputed);
tests/test_solve_exact.py checks the same on random problems by enumeration.
No timings are asserted: benchmarks/big_plans.py measures them.
"""

from __future__ import annotations

import functools


import pytest
import torch

import autotp
from autotp.api import _placeholder_grads
from autotp.capture import capture
from autotp.cost.profile import load_profile
from autotp.graph import build_opgraph
from autotp.solve.backends import highs_available
from autotp.solve.ilp import _BYTES, MemoryInfeasible, solve
from autotp.solve.problem import Problem, build_problem
from autotp.solve.step import memory_bytes
from autotp.strategies import default_registry, enumerate_strategies
from autotp.strategies.enumerate import prune_unreachable
from conftest import compute_bound_profile
from helpers import make_model
from models import GPT

SOLVERS = ["cbc", "highs"] if highs_available() else ["cbc"]


# ---- the same objective with and without the reduction, on real models ------------------------------------------

def _problem(model, inputs, mesh, profile, overlap=False) -> Problem:
    gm = capture(model, inputs, {})
    graph = build_opgraph(gm, _placeholder_grads(gm, inputs, {}))
    strategies = enumerate_strategies(graph, mesh.shape, default_registry(), optimizer_sharding=True)
    prune_unreachable(graph, strategies)
    return build_problem(graph, strategies, mesh, load_profile(profile), True, overlap)


def _gpt(mesh: str):
    model, inputs = make_model("gpt")
    return _problem(model, inputs, autotp.Mesh(mesh), compute_bound_profile())


def _meta_gpt_overlap():
    with torch.device("meta"):
        model = GPT(vocab=32768, hidden=4096, heads=64, layers=2, seq=1024)
    idx = torch.zeros(16, 1024, dtype=torch.long, device="meta")
    mesh = autotp.Mesh((2, 8), names=("dp", "tp"), links=("ethernet", "nvlink"))
    return _problem(model, (idx, idx), mesh, "ethernet-2node", overlap=True)


def _memory(problem, solution) -> int:
    return memory_bytes(problem, solution.choice, solution.recompute, solution.regather)


def _smallest(problem, solver) -> float:
    """The least memory any plan needs, in bytes, with and without the reduction (checked equal)."""
    found = []
    for reduce in (True, False):
        with pytest.raises(MemoryInfeasible) as caught:
            solve(problem, memory_limit_bytes=1, solver=solver, reduce=reduce)
        found.append(caught.value.smallest.objective_s * _BYTES)
    assert found[0] == pytest.approx(found[1], rel=1e-9)
    return found[0]


_PROBLEMS = {"gpt-4": lambda: _gpt("4"), "gpt-2x2": lambda: _gpt("2x2"), "meta-gpt-2x8-overlap": _meta_gpt_overlap}


@functools.lru_cache(maxsize=None)
def _cached(name: str) -> Problem:
    return _PROBLEMS[name]()


# every problem with one solver, the small one with both: the reduction is the same whichever solver runs
# after it (tests/test_layer_sharing.py compares the solvers), and the unreduced ILPs are slow under CBC
@pytest.mark.parametrize("name, solver", [("gpt-4", s) for s in SOLVERS]
                         + [("gpt-2x2", SOLVERS[-1]), ("meta-gpt-2x8-overlap", SOLVERS[-1])])
def test_same_optimum_with_and_without_the_reduction(name, solver):
    problem = _cached(name)
    assert problem.recompute  # the layer classes' recomputation rows join the ILP under the limit below
    free = [solve(problem, solver=solver, reduce=reduce) for reduce in (True, False)]
    assert free[0].objective_s == pytest.approx(free[1].objective_s, rel=1e-9)
    assert free[0].variables < free[1].variables
    # a limit between the least memory and the unconstrained optimum's: the knapsack binds
    limit = (_smallest(problem, solver) + _memory(problem, free[1])) / 2
    limited = [solve(problem, memory_limit_bytes=limit, solver=solver, reduce=reduce) for reduce in (True, False)]
    assert limited[0].objective_s == pytest.approx(limited[1].objective_s, rel=1e-9)
    assert limited[0].objective_s >= free[0].objective_s * (1 - 1e-9)
    assert all(_memory(problem, s) <= limit for s in limited)
