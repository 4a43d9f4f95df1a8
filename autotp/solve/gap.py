"""A time-limited solve: a starting incumbent, an honest lower bound, and the optimality gap between them.

With ``time_limit_s`` the solver may stop before it proves its best plan
optimal, or before it finds any plan at all (on a GPT on a 2x2 mesh it is still reading
and presolving after 0.2 s). Three pieces make the limit useful:

* a **warm start**: every group starts on its fully replicated strategy where
  it has one, completed to every variable by one LP with those choices
  fixed, and handed to CBC (``warmStart``) or HiGHS (``setSolution``). That
  plan always exists for an unconstrained model, so a solver stopped at any
  time still holds a valid incumbent at least this good;
* a **lower bound**: CBC's best bound is not returned through pulp, so the bound here
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

from autotp.errors import SolverGapWarning
from autotp.solve.backends import CUT_OFF, highs_available, solve_lp

LP_MIN_LIMIT_S = 10.0  # the relaxation is one LP, far cheaper than the integer search it bounds
# HiGHS's simplex settles the relaxations here in 1,000 to 7,500 iterations (Llama-2-70B on 4x8, batches 8 and 64:
# a second or two), but can spend minutes proving one infeasible. Its budgets are iterations, not seconds, so that
# the search takes the same path on any machine under any load: on a machine half as fast, or sharing its cores
# with another lane, two seconds were some 1,500 iterations, and relaxations that settled 100 iterations later
# were asked the cheaper proof below first (3 s each at batch 8).
SIMPLEX_QUICK_ITERATIONS = 10_000  # a relaxation not settled by then may be infeasible: worth a cheaper proof
SIMPLEX_FIRST_ITERATIONS = 50_000  # nor by then: the interior-point method takes over
SIMPLEX_FIRST_S = 10.0  # under a time limit, the simplex's share of it at most


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


def warm_start_replicated(x: dict, choices: dict[str, int]) -> int:
    """Set starting values so that each group starts on its fully replicated choice (``choices``:
    `replicated_choices`, which the caller has found once for dead-end elimination too).

    ``x`` maps a group leader to ``{choice: binary variable}`` (`autotp.solve.linear.Var`).
    Groups without a replicated choice (pinned to a split) are left for the
    solver to complete; if the start is infeasible (a memory limit), it is
    dropped (`complete_start`). Returns how many groups were given a start.
    """
    started = 0
    for name, replicated in choices.items():
        variables = x.get(name, {})
        if replicated not in variables:
            continue
        for c, var in variables.items():
            var.model.start[var.index] = 1.0 if c == replicated else 0.0
        started += 1
    return started


def complete_start(model) -> bool:
    """Extend the binaries' starting values to a start for every variable, or drop the start.

    CBC completes a partial start by itself; HiGHS does not within a short
    limit. So the LP with every started binary fixed to its value is solved
    once (cheap: no integer search), and its solution becomes the start. If
    that LP is infeasible (a memory limit the replicated plan breaks), the
    start is cleared and the solver starts cold. Returns whether a start remains.
    """
    started = dict(model.start)
    if not started:
        return False
    bounds = {i: (model.lower[i], model.upper[i]) for i in started}
    for i, value in started.items():
        model.set_bounds(i, value, value)
    try:
        solve_lp(model, LP_MIN_LIMIT_S)
        feasible = model.has_solution and model.proven
    finally:
        for i, (low, up) in bounds.items():
            model.set_bounds(i, low, up)
    model.start = {i: v for i, v in enumerate(model.values)} if feasible else {}
    return feasible


def lp_relaxation_bound(model, time_limit_s: float | None = None, cutoff: float | None = None,
                        infeasible=None) -> float | None:
    """The LP relaxation's optimum of ``model`` (a lower bound for a minimisation), or None if unsolved.

    With ``cutoff``, HiGHS's dual simplex stops once its objective (a lower
    bound at every iteration) passes ``cutoff``, and ``cutoff`` is returned:
    all a caller that skips what the cutoff beats needs, in a fraction of
    the time. ``infeasible()``, when given, is asked once the simplex has
    run `SIMPLEX_QUICK_ITERATIONS` without settling: a cheaper proof that no
    fractional plan exists (the least memory any reaches, over the limit;
    the simplex spends its longest runs proving just that). If it says so,
    ``model.status`` is ``"Infeasible"`` and None is returned; else the
    simplex goes on from where it stopped.

    Solving overwrites the variables' values: read the integer incumbent first.
    Only an optimal LP value is a bound (a simplex stopped early is not), so
    anything else returns None (``model.status`` then says whether it is
    infeasible). The LP gets its own limit, at least `LP_MIN_LIMIT_S`: a limit
    too small for the solver to read the problem would leave every gap
    unknown. HiGHS solves it when installed, else CBC
    (`autotp.solve.backends.solve_lp`): its simplex for
    `SIMPLEX_FIRST_ITERATIONS` (and at most `SIMPLEX_FIRST_S` of a time
    limit), then, if that did not settle it, its interior point method for
    the rest of the limit.
    """
    highs = highs_available()
    if time_limit_s is not None:
        time_limit_s = max(time_limit_s, LP_MIN_LIMIT_S)
    first = None if time_limit_s is None else min(time_limit_s, SIMPLEX_FIRST_S)
    started = time.perf_counter()
    quick = infeasible is not None and highs
    if quick:
        solve_lp(model, first, cutoff=cutoff, iterations=SIMPLEX_QUICK_ITERATIONS)
        if model.status == "Not Solved" and infeasible():
            model.status = "Infeasible"
            return None
    if not quick or model.status == "Not Solved":  # the simplex goes on from its last basis
        if highs:
            left = None if first is None else max(0.0, first - (time.perf_counter() - started))
            solve_lp(model, left, cutoff=cutoff,
                     iterations=SIMPLEX_FIRST_ITERATIONS - (SIMPLEX_QUICK_ITERATIONS if quick else 0))
        else:
            solve_lp(model, time_limit_s, cutoff=cutoff)
    if model.status == CUT_OFF:
        return cutoff
    if not model.proven and model.status != "Infeasible" and highs:
        rest = None if time_limit_s is None else time_limit_s - (time.perf_counter() - started)
        if rest is None or rest > 0:
            solve_lp(model, rest, interior=True)
    if not (model.has_solution and model.proven):
        return None
    return model.objective_value or 0.0


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
