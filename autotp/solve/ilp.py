"""The ILP: one binary choice per group, edge-pair variables for resharding costs. The only pulp user.

Linearisation (Alpa's row/column-sum encoding): for an edge between groups u
and v, continuous ``y[i][j] >= 0`` with ``sum_j y[i][j] = x_u[i]`` and
``sum_i y[i][j] = x_v[j]``. With one-hot ``x`` this forces ``y`` to the one
chosen pair, and the LP relaxation stays tight. Pairs that cannot happen
(infinite cost) get no variable, nor do the choices and pairs that dead-end
elimination proves unneeded (`autotp.solve.reduce`: the same optimum, often
half the variables). Variables are named after fx nodes.
Coefficients are scaled to microseconds and MiB for the solver's tolerances;
the objective is reported in seconds. A memory limit is one more linear
constraint: the sum over groups of each choice's bytes per device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp

from autotp.errors import SolverError
from autotp.solve import backends
from autotp.solve.gap import (complete_start, lp_relaxation_bound, optimality_gap, replicated_choices,
                              warm_start_replicated, warn_gap)
from autotp.solve.problem import Problem
from autotp.solve.reduce import possible, reduce_problem

_SCALE = 1e6  # seconds -> microseconds inside the solver
_BYTES = 2 ** 20  # bytes -> MiB inside the solver


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # group leader -> chosen index
    objective_s: float
    variables: int
    constraints: int
    solve_s: float
    status: str
    gap: float | None = None  # only when a time limit stopped the solver: (objective - bound) / objective


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


class MemoryInfeasible(Exception):
    """No choice fits the memory limit; ``smallest`` is the solution that uses the least memory."""

    def __init__(self, smallest: "Solution"):
        super().__init__("no plan fits the memory limit")
        self.smallest = smallest


def _model(problem: Problem, minimise: str, memory_limit_bytes: float | None, reduce: bool = True):
    """The ILP minimising step time (``"time"``) or per-device memory (``"memory"``).

    ``reduce``: only the choices and pairs `reduce_problem` leaves get variables;
    the replicated plan is kept among them, as the warm start of a time-limited solve.
    """
    lp = pulp.LpProblem("autotp", pulp.LpMinimize)
    x, objective, memory, overlap, backward = {}, [], [], [], []
    reduced = reduce_problem(problem, time=minimise == "time",
                             memory=minimise == "memory" or memory_limit_bytes is not None,
                             keep=replicated_choices(problem)) if reduce else possible(problem)
    for name, group in problem.groups.items():
        allowed = reduced.choices[name]
        if not allowed:
            raise SolverError(f"op {name!r} has no strategy with a finite cost; this is a bug, please report it")
        x[name] = {c: pulp.LpVariable(f"x_{_safe(name)}_{c}", cat="Binary") for c in allowed}
        lp += pulp.lpSum(x[name].values()) == 1, f"one_{_safe(name)}"
        objective += [group.cost_s[c] * _SCALE * v for c, v in x[name].items()]
        memory += [group.memory_bytes[c] / _BYTES * v for c, v in x[name].items()]
        overlap += [group.overlap_s[c] * _SCALE * v for c, v in x[name].items() if group.overlap_s[c]]
        backward += [group.backward_s[c] * _SCALE * v for c, v in x[name].items() if group.backward_s[c]]
    for (gu, gv), table in problem.edges.items():
        tag = f"{_safe(gu)}__{_safe(gv)}"
        y = _pair_variables(lp, x[gu], x[gv], reduced.pairs[gu, gv], tag)
        objective += _terms(y, table)
        overlap += _terms(y, problem.overlap_edges.get((gu, gv)))
    if overlap:  # gradient reductions cost only what the backward compute cannot hide
        exposed = pulp.LpVariable("exposed_gradient_reduction", lowBound=0)
        lp += exposed >= pulp.lpSum(overlap) - pulp.lpSum(backward), "overlap_with_backward"
        objective.append(exposed)
    if memory_limit_bytes is not None:
        lp += pulp.lpSum(memory) <= memory_limit_bytes / _BYTES, "memory_limit"
    lp += pulp.lpSum(objective if minimise == "time" else memory)
    warm_start_replicated(problem, x)  # CBC starts from it only under a time limit (autotp.solve.gap)
    return lp, x


def _run(lp, x, time_limit_s, solver: str = "cbc") -> Solution:
    start = time.perf_counter()
    if time_limit_s is not None:
        complete_start(lp)  # a start for every variable: a solver stopped at the limit still holds a plan
    lp.solve(backends.command(solver, time_limit_s))
    elapsed = time.perf_counter() - start
    status = pulp.LpStatus[lp.status]
    if status != "Optimal":
        return Solution({}, math.inf, len(lp.variables()), len(lp.constraints), elapsed, status)
    choice = {name: next(c for c, v in xs.items() if v.value() > 0.5) for name, xs in x.items()}
    objective, gap = pulp.value(lp.objective), None
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped at the time limit holding an incumbent
        gap = optimality_gap(objective, lp_relaxation_bound(lp, time_limit_s))
    return Solution(choice, objective, len(lp.variables()), len(lp.constraints), elapsed, status, gap)


def solve(problem: Problem, time_limit_s: float | None = None, memory_limit_bytes: float | None = None,
          solver: str = "auto", reduce: bool = True) -> Solution:
    """Pick one strategy per group minimising total predicted step time, within the memory limit.

    ``solver`` is ``"auto"``, ``"cbc"`` or ``"highs"`` (`autotp.solve.backends`).
    ``reduce=False`` skips dead-end elimination (`autotp.solve.reduce`): the
    same optimum from a larger ILP, for tests and comparisons.
    Raises `MemoryInfeasible` carrying the least-memory plan when nothing fits.
    """
    solver = backends.resolve(solver, memory_limit_bytes is not None)
    solution = _run(*_model(problem, "time", memory_limit_bytes, reduce), time_limit_s, solver)
    if solution.status == "Infeasible" and memory_limit_bytes is not None:
        # no limit: the error quotes this exact minimum
        smallest = _run(*_model(problem, "memory", None, reduce), None, solver)
        if time_limit_s is None or smallest.objective_s * _BYTES > memory_limit_bytes:
            raise MemoryInfeasible(smallest)
        # a CBC stopped by its time limit can call a feasible problem infeasible: report the limit instead
        solution = Solution({}, math.inf, solution.variables, solution.constraints, solution.solve_s, "Not Solved")
    if solution.status != "Optimal":
        if time_limit_s is not None and solution.status == "Not Solved":
            raise SolverError(f"the ILP solver found no plan within time_limit_s={time_limit_s:g} s: raise the "
                              "time limit (or drop it)")
        raise SolverError(f"the ILP solver returned {solution.status!r}; try a longer time limit or fewer mesh axes")
    if solution.gap is not None:
        warn_gap(solution.gap, time_limit_s)
    return Solution(solution.choice, solution.objective_s / _SCALE, solution.variables, solution.constraints,
                    solution.solve_s, solution.status, solution.gap)


def _pair_variables(lp, xu: dict, xv: dict, kept, tag: str) -> dict:
    """Edge-pair variables and their row/column-sum constraints; only ``kept[i][j]`` pairs get one."""
    y = {(i, j): pulp.LpVariable(f"y_{tag}_{i}_{j}", lowBound=0) for i in xu for j in xv if kept[i][j]}
    for i, var in xu.items():
        lp += pulp.lpSum(y[i, j] for j in xv if (i, j) in y) == var, f"row_{tag}_{i}"
    for j, var in xv.items():
        lp += pulp.lpSum(y[i, j] for i in xu if (i, j) in y) == var, f"col_{tag}_{j}"
    return y


def _terms(y: dict, table) -> list:
    if table is None:
        return []
    return [table[i][j] * _SCALE * v for (i, j), v in y.items() if table[i][j] != 0]
