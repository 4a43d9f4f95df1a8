"""Dead-end elimination (`autotp.solve.reduce`) shrinks the ILP and never changes its optimum.

Two checks: on small random problems, full enumeration shows that the best
plan left after the reduction is the best plan of all (with ties, infinite
costs, a memory limit and gradient overlap); on real models, both solvers
reach the same objective with and without the reduction, from fewer variables.
No timings are asserted: benchmarks/big_plans.py measures them.
"""

from __future__ import annotations

import functools

import itertools
import math
import random

import pytest
import torch

import autotp
from autotp.api import _placeholder_grads
from autotp.capture import capture
from autotp.cost.profile import load_profile
from autotp.graph import build_opgraph
from autotp.solve.backends import highs_available
from autotp.solve.ilp import _BYTES, MemoryInfeasible, solve
from autotp.solve.problem import Group, Problem, build_problem
from autotp.solve.reduce import reduce_problem
from autotp.strategies import default_registry, enumerate_strategies
from autotp.strategies.enumerate import prune_unreachable
from conftest import compute_bound_profile
from helpers import make_model
from models import GPT

SOLVERS = ["cbc", "highs"] if highs_available() else ["cbc"]


# ---- exactness by enumeration, on random problems -------------------------------------------------------------

def _random_problem(rng: random.Random, overlap: bool) -> Problem:
    """5 to 6 groups of 2 to 4 choices on a random graph, values drawn from few levels so that ties abound."""
    names = [f"g{i}" for i in range(rng.randint(5, 6))]
    level = lambda: rng.choice([0.0, 1.0, 1.0, 2.0, 3.0])
    groups = {}
    for name in names:
        n = rng.randint(2, 4)
        groups[name] = Group(name, {name: list(range(n))}, [level() if rng.random() > 0.1 else math.inf
                                                             for _ in range(n)],
                             [level() if overlap else 0.0 for _ in range(n)], [level() for _ in range(n)],
                             [rng.choice([1, 2, 2, 4]) for _ in range(n)])
    edges, overlap_edges = {}, {}
    for u, v in itertools.permutations(names, 2):  # both directions at times: groups can feed each other
        if rng.random() < (0.4 if u < v else 0.1):
            edges[u, v] = [[level() if rng.random() > 0.15 else math.inf for _ in range(groups[v].n)]
                           for _ in range(groups[u].n)]
            if overlap:
                overlap_edges[u, v] = [[level() for _ in range(groups[v].n)] for _ in range(groups[u].n)]
    return Problem(groups, {name: name for name in names}, edges, None, overlap_edges, overlap)


def _plans(problem: Problem, reduction=None):
    """Every plan the reduction leaves (all when ``None``) with its time and memory; impossible ones skipped."""
    names = list(problem.groups)
    for picks in itertools.product(*(range(problem.groups[g].n) for g in names)):
        choice = dict(zip(names, picks))
        if reduction and (any(choice[g] not in reduction.choices[g] for g in names)
                          or any(not reduction.pairs[u, v][choice[u], choice[v]] for u, v in problem.edges)):
            continue
        exposed = sum(problem.groups[g].cost_s[c] for g, c in choice.items())
        exposed += sum(t[choice[u]][choice[v]] for (u, v), t in problem.edges.items())
        if math.isinf(exposed):
            continue
        overlap = sum(problem.groups[g].overlap_s[c] for g, c in choice.items())
        overlap += sum(t[choice[u]][choice[v]] for (u, v), t in problem.overlap_edges.items())
        backward = sum(problem.groups[g].backward_s[c] for g, c in choice.items())
        memory = sum(problem.groups[g].memory_bytes[c] for g, c in choice.items())
        yield choice, exposed + max(0.0, overlap - backward), memory


def _best(plans, limit=None, by="time"):
    values = [(t, m) if by == "time" else (m, t) for _, t, m in plans if limit is None or m <= limit]
    return min(values)[0] if values else None


@pytest.mark.parametrize("seed", range(60))
def test_reduction_keeps_the_optimum_of_every_random_problem(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng, overlap=seed % 2 == 1)
    every = list(_plans(problem))
    if not every:
        return
    memories = sorted({m for _, _, m in every})
    limit = memories[len(memories) // 3]  # binding: the fastest plans do not fit
    start = rng.choice(every)[0]  # a partial plan to keep, as the replicated warm start is kept
    kept = {g: c for g, c in start.items() if rng.random() < 0.6}
    agrees = lambda plans: [p for p in plans if all(p[0][g] == c for g, c in kept.items())]
    for time, memory, cap in ((True, False, None), (True, True, limit), (False, True, None)):
        by = "time" if time else "memory"
        reduction = reduce_problem(problem, time=time, memory=memory, keep=kept)
        left = list(_plans(problem, reduction))
        assert _best(left, cap, by) == _best(every, cap, by), (seed, by, cap)
        assert _best(agrees(left), None, by) == _best(agrees(every), None, by), (seed, by, kept)


def test_ties_keep_one_choice():
    """Two identical choices and a worse one: the first stays, the others go."""
    group = Group("a", {"a": [0, 1, 2]}, [1.0, 1.0, 2.0], [0.0] * 3, [0.0] * 3, [8, 8, 8])
    other = Group("b", {"b": [0, 1]}, [0.0, 0.0], [0.0] * 2, [0.0] * 2, [1, 1])
    problem = Problem({"a": group, "b": other}, {"a": "a", "b": "b"}, {("a", "b"): [[1.0, 2.0]] * 3}, None)
    reduction = reduce_problem(problem, time=True, memory=True)
    assert reduction.choices == {"a": [0], "b": [0]}


# ---- the same objective with and without the reduction, on real models ------------------------------------------

def _problem(model, inputs, mesh, profile, overlap=False) -> Problem:
    gm = capture(model, inputs, {})
    graph = build_opgraph(gm, _placeholder_grads(gm, inputs, {}))
    strategies = enumerate_strategies(graph, mesh.shape, default_registry())
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
    return sum(problem.groups[g].memory_bytes[c] for g, c in solution.choice.items())


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
# after it (tests/test_layer_sharing.py compares the solvers), and the unreduced 2x8 ILP is slow
@pytest.mark.parametrize("name, solver", [("gpt-4", s) for s in SOLVERS]
                         + [("gpt-2x2", "cbc"), ("meta-gpt-2x8-overlap", SOLVERS[-1])])
def test_same_optimum_with_and_without_the_reduction(name, solver):
    problem = _cached(name)
    free = [solve(problem, solver=solver, reduce=reduce) for reduce in (True, False)]
    assert free[0].objective_s == pytest.approx(free[1].objective_s, rel=1e-9)
    assert free[0].variables < free[1].variables
    # a limit between the least memory and the unconstrained optimum's: the knapsack binds
    limit = (_smallest(problem, solver) + _memory(problem, free[1])) / 2
    limited = [solve(problem, memory_limit_bytes=limit, solver=solver, reduce=reduce) for reduce in (True, False)]
    assert limited[0].objective_s == pytest.approx(limited[1].objective_s, rel=1e-9)
    assert limited[0].objective_s >= free[0].objective_s * (1 - 1e-9)
    assert all(_memory(problem, s) <= limit for s in limited)
