"""A time-limited solve: a starting incumbent, an honest lower bound, and the optimality gap between them.

With ``time_limit_s`` the solver may stop before it proves its best plan
optimal, or before it finds any plan at all (on a GPT on a 2x2 mesh it is still reading
and presolving after 0.2 s). Three pieces make the limit useful:

* a **warm start**: every group starts on its fully replicated strategy where
  it has one, completed to every variable by one LP with those choices
  fixed, and handed to CBC (``warmStart``) or HiGHS (``setSolution``). That
  plan always exists for an unconstrained model, so a solver stopped at any
  time still holds a valid incumbent at least this good;
* a **lower bound**: pulp does not return CBC's best bound, so the bound here
  is the optimum of the LP relaxation of the same problem (integrality
  dropped, everything else equal). Every integer plan costs at least this
  much, so it is a valid bound; the edge encoding keeps the relaxation tight
  (see ``autotp.solve.ilp``), so it is also a close one;
* the **gap** ``(incumbent - bound) / incumbent``, reported through
  `SolverGapWarning` and recorded in ``plan.stats["gap"]``.
"""

from __future__ import annotations

import math
import time
import warnings

import pulp

from autotp.errors import SolverGapWarning

LP_MIN_LIMIT_S = 10.0  # the relaxation is one LP, far cheaper than the integer search it bounds
# HiGHS's simplex settles most relaxations here in a second or two, but can spend minutes proving one infeasible
SIMPLEX_FIRST_S = 10.0


def replicated_choices(problem) -> dict[str, int]:
    """Each group's first possible (finite-cost) choice that replicates every member, where it has one."""
    choices = {}
    if problem.strategies is None:  # a problem built by hand, without ops behind it
        return choices
    for name, group in problem.groups.items():
        replicated = next((c for c in range(group.n) if not math.isinf(group.cost_s[c])
                           and all(problem.strategy(member, c).is_replicated for member in group.choices)), None)
        if replicated is not None:
            choices[name] = replicated
    return choices


def warm_start_replicated(problem, x: dict) -> int:
    """Set pulp initial values so that each group starts on its fully replicated choice.

    ``x`` maps a group leader to ``{choice: binary variable}``. Groups without
    a replicated choice (pinned to a split) are left for CBC to complete; if
    the start is infeasible (a memory limit), CBC ignores it. Returns how many
    groups were given a start.
    """
    started = 0
    for name, replicated in replicated_choices(problem).items():
        variables = x.get(name, {})
        if replicated not in variables:
            continue
        for c, var in variables.items():
            var.setInitialValue(1 if c == replicated else 0)
        started += 1
    return started


def complete_start(lp: pulp.LpProblem) -> bool:
    """Extend the binaries' initial values to a start for every variable, or drop the start.

    CBC completes a partial start by itself; HiGHS does not within a short
    limit. So the LP with every started binary fixed to its value is solved
    once (cheap: no integer search), and its solution becomes the start. If
    that LP is infeasible (a memory limit the replicated plan breaks), every
    initial value is cleared and the solver starts cold. Returns whether a
    start remains.
    """
    started = [(v, v.lowBound, v.upBound) for v in lp.variables() if v.varValue is not None]
    if not started:
        return False
    for var, _, _ in started:
        var.lowBound = var.upBound = var.varValue
    try:
        lp.solve(pulp.PULP_CBC_CMD(msg=False, mip=False, timeLimit=LP_MIN_LIMIT_S, threads=1))
        feasible = lp.sol_status == pulp.LpSolutionOptimal
    finally:
        for var, low, up in started:
            var.lowBound, var.upBound = low, up
    if not feasible:
        for var in lp.variables():
            var.varValue = None
    return feasible


def set_highs_start(lp: pulp.LpProblem) -> None:
    """Hand the variables' initial values to a highspy model built by pulp (``lp.solverModel``)."""
    import numpy as np

    given = [(v.index, v.varValue) for v in lp.variables() if v.varValue is not None]
    if given:
        lp.solverModel.setSolution(len(given), np.array([i for i, _ in given], dtype=np.int32),
                                   np.array([value for _, value in given], dtype=np.float64))


def lp_relaxation_bound(lp: pulp.LpProblem, time_limit_s: float | None = None) -> float | None:
    """The LP relaxation's optimum of ``lp`` (a lower bound for a minimisation), or None if unsolved.

    Solving overwrites the variables' values: read the integer incumbent first.
    Only an optimal LP value is a bound (a simplex stopped early is not), so
    anything else returns None (``lp.status`` then says whether it is
    infeasible). The LP gets its own limit, at least `LP_MIN_LIMIT_S`: a limit
    too small for the solver to read the problem would leave every gap
    unknown. HiGHS solves it when installed, else CBC
    (`autotp.solve.backends.lp_command`): its simplex for `SIMPLEX_FIRST_S`
    (a second or two on most), then, if that did not settle it, its interior
    point method for the rest of the limit.
    """
    if time_limit_s is not None:
        time_limit_s = max(time_limit_s, LP_MIN_LIMIT_S)
    from autotp.solve.backends import highs_available, lp_command  # backends imports this module

    first = SIMPLEX_FIRST_S if time_limit_s is None else min(time_limit_s, SIMPLEX_FIRST_S)
    started = time.perf_counter()
    lp.solve(lp_command(first if highs_available() else time_limit_s))
    if (lp.sol_status != pulp.LpSolutionOptimal and lp.status != pulp.LpStatusInfeasible and highs_available()
            and (time_limit_s is None or time_limit_s > first)):
        rest = None if time_limit_s is None else time_limit_s - (time.perf_counter() - started)
        if rest is None or rest > 0:
            lp.solve(lp_command(rest, interior=True))
    if lp.sol_status != pulp.LpSolutionOptimal:  # pulp calls "stopped on time with a value" Optimal too
        return None
    return pulp.value(lp.objective) or 0.0


def optimality_gap(incumbent: float, bound: float | None) -> float:
    """``(incumbent - bound) / incumbent``, in [0, 1]; ``nan`` when no bound is known."""
    if bound is None or math.isnan(bound):
        return math.nan
    if incumbent <= 0:
        return 0.0
    return min(1.0, max(0.0, (incumbent - bound) / incumbent))


def warn_gap(gap: float, time_limit_s: float) -> None:
    """Tell the caller the plan was not proven optimal, by how much it may be off, and the fix."""
    within = "an unknown distance" if math.isnan(gap) else f"{gap:.1%}"
    warnings.warn(SolverGapWarning(
        f"the solver stopped at its {time_limit_s:g} s time limit: the plan is the best found, within {within} "
        f"of optimal (gap = (plan - LP-relaxation bound) / plan = {gap:.4f}); raise time_limit_s for a "
        "better or proven-optimal plan"), stacklevel=5)
