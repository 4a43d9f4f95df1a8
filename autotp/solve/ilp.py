"""The ILP: one binary choice per group, edge-pair variables for resharding costs. The only pulp user.

Linearisation (Alpa's row/column-sum encoding): for an edge between groups u
and v, continuous ``y[i][j] >= 0`` with ``sum_j y[i][j] = x_u[i]`` and
``sum_i y[i][j] = x_v[j]``. With one-hot ``x`` this forces ``y`` to the one
chosen pair, and the LP relaxation stays tight. Pairs that cannot happen
(infinite cost) get no variable. Variables are named after fx nodes.
Coefficients are scaled to microseconds for the solver's tolerances; the
objective is reported in seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp

from autotp.errors import SolverError
from autotp.solve.problem import Problem

_SCALE = 1e6  # seconds -> microseconds inside the solver


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # group leader -> chosen index
    objective_s: float
    variables: int
    constraints: int
    solve_s: float
    status: str


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


def solve(problem: Problem, time_limit_s: float | None = None) -> Solution:
    """Pick one strategy per group minimising total predicted step time."""
    lp = pulp.LpProblem("autotp", pulp.LpMinimize)
    x = {}
    objective = []
    for name, group in problem.groups.items():
        allowed = [c for c in range(group.n) if not math.isinf(group.cost_s[c])]
        if not allowed:
            raise SolverError(f"op {name!r} has no strategy with a finite cost; this is a bug, please report it")
        x[name] = {c: pulp.LpVariable(f"x_{_safe(name)}_{c}", cat="Binary") for c in allowed}
        lp += pulp.lpSum(x[name].values()) == 1, f"one_{_safe(name)}"
        objective += [group.cost_s[c] * _SCALE * v for c, v in x[name].items()]
    for (gu, gv), table in problem.edges.items():
        objective += _edge_terms(lp, x[gu], x[gv], table, f"{_safe(gu)}__{_safe(gv)}")
    lp += pulp.lpSum(objective)
    start = time.perf_counter()
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1)
    lp.solve(solver)
    elapsed = time.perf_counter() - start
    status = pulp.LpStatus[lp.status]
    if status != "Optimal":
        raise SolverError(f"the ILP solver returned {status!r}; try a longer time limit or fewer mesh axes")
    choice = {name: next(c for c, v in xs.items() if v.value() > 0.5) for name, xs in x.items()}
    return Solution(choice, pulp.value(lp.objective) / _SCALE, len(lp.variables()), len(lp.constraints),
                    elapsed, status)


def _edge_terms(lp, xu: dict, xv: dict, table, tag: str) -> list:
    y = {(i, j): pulp.LpVariable(f"y_{tag}_{i}_{j}", lowBound=0)
         for i in xu for j in xv if not math.isinf(table[i][j])}
    for i, var in xu.items():
        lp += pulp.lpSum(y[i, j] for j in xv if (i, j) in y) == var, f"row_{tag}_{i}"
    for j, var in xv.items():
        lp += pulp.lpSum(y[i, j] for i in xu if (i, j) in y) == var, f"col_{tag}_{j}"
    return [table[i][j] * _SCALE * v for (i, j), v in y.items() if table[i][j] != 0]
