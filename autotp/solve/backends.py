"""Which MILP solver runs the ILP, and how: HiGHS (``highspy``, a dependency) or CBC (bundled with pulp).

The ILP is a `autotp.solve.linear.Model` (arrays); HiGHS receives them in
one ``passModel``, CBC through a pulp model built from them.

Both are exact branch-and-bound solvers run single-threaded, so a plan is
deterministic. "auto" is HiGHS when highspy is installed, CBC otherwise: on
the ILPs of docs/planning.md HiGHS is as fast or up to ten times faster (the
2-D meshes, where the gradient chain's LP relaxation needs cuts and
branching). HiGHS keeps its presolve: without it Llama-2-70B's ILP at batch
64 in 16 micro-batches ran past 150 s where with it the optimum is proven in
9 s (the batch-8 one, with no limit: 4.9 s against 10.6 s). Its probing
(each binary tried at 0 and 1 to find implications) is off: on those ILPs
it was half of the MIP's time (6.7 s of presolve, 2.7 s without it, the
optimum the same: 70B at batch 8 under the limit solved in 4.2 s instead of
8.5, at batch 64 in 7.9 s instead of 16.3). So is its enumeration (every
combination of a small row's binaries, run again at each restart): the
MIPs that prove Llama-2-70B's plans close at the root node, and it removed
9 columns of 43,000 there (the CPU seconds of the four such MIPs at batches
8 and 64, three runs each: 2.5, 2.2, 4.1 and 1.8 s with it, 1.7, 1.5, 2.6
and 1.8 s without; the optima the same). An LP relaxation alone
runs without presolve: HiGHS's dual simplex solves these in about a
second from the raw model, where presolving them first took 3 to 66 s. CBC runs
without its feasibility pump (seconds spent before the branching that
proves the optimum; its other heuristics still run), which does not loosen
optimality (the gap stays 0).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

from autotp.errors import SolverError

SOLVERS = ("auto", "cbc", "highs")


def highs_available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def resolve(name: str) -> str:
    """``"auto"``: HiGHS if installed, else CBC; ``"highs"`` needs highspy."""
    if name not in SOLVERS:
        raise SolverError(f"unknown solver {name!r}: use one of {', '.join(SOLVERS)}")
    if name == "auto":
        return "highs" if highs_available() else "cbc"
    if name == "highs" and not highs_available():
        raise SolverError("solver 'highs' needs highspy: pip install highspy (or use solver='cbc')")
    return name


CUT_OFF = "Cut off"  # the status of a relaxation whose optimum is proven to be at least its cutoff

# HiGHS's presolve rules are bits of ``presolve_rule_off`` in the order of its ``PresolveRuleType``; probing is
# bit 15 and enumeration bit 16 from HiGHS 1.13 on (hence highspy>=1.13 in pyproject.toml)
_PROBING = 1 << 15
_ENUMERATION = 1 << 16


def solve_mip(model, name: str, time_limit_s: float | None, cutoff: float | None = None) -> None:
    """Solve ``model`` with its integrality, single-threaded, to a zero gap, by ``name`` (already resolved);
    with a time limit, from ``model.start`` (see `autotp.solve.gap`). The result is left on ``model``.
    ``cutoff``: only plans below it are wanted (HiGHS prunes the rest; with none, the status is
    ``"Infeasible"``); CBC ignores it."""
    if name == "highs":
        h = _highs(model, integral=True)
        _options(h, threads=1, mip_rel_gap=0.0, presolve_rule_off=_PROBING | _ENUMERATION,
                 time_limit=_limit(time_limit_s),
                 objective_bound=math.inf if cutoff is None else cutoff)
        if time_limit_s is not None and model.start:
            _start(h, model.start)
        h.run()
        _read(model, h)
    else:
        _cbc(model, integral=True, time_limit_s=time_limit_s)


def solve_lp(model, time_limit_s: float | None, interior: bool = False, cutoff: float | None = None,
             iterations: int | None = None) -> None:
    """Solve ``model``'s LP relaxation (integrality dropped): HiGHS's simplex when installed, else CBC's.

    HiGHS is the robust one: CBC's simplex has been seen to run for over twenty
    minutes on a relaxation HiGHS solves in seconds (Llama-2-70B at batch 64).
    Without presolve, which costs more than it saves on these LPs (above).
    The HiGHS object is kept on the model (``model.relaxed``): the next
    relaxation, after bounds changed (`autotp.solve.linear.Model.set_bounds`),
    starts from this one's basis. ``interior``: HiGHS's interior-point
    method instead, without crossover (the optimum's value is all a bound
    needs), which settles in seconds the relaxations the simplex takes
    minutes over (an infeasible one, in phase 1). ``cutoff``: the dual
    simplex stops once its objective, a lower bound of the optimum at every
    iteration, passes it (status `CUT_OFF`; HiGHS's ``objective_bound``).
    ``iterations``: the simplex stops after that many (``"Not Solved"`` unless
    it settled), and the next call goes on from where it stopped: a budget
    that, unlike a time limit, is the same work on any machine under any load.
    """
    if not highs_available():
        _cbc(model, integral=False, time_limit_s=time_limit_s)
        return
    if model.relaxed is None:
        model.relaxed = _highs(model, integral=False)
        _options(model.relaxed, threads=1, presolve="off")
    h = model.relaxed
    # HiGHS's clock runs on over an object's solves, and its time limit is read against it
    _options(h, time_limit=h.getRunTime() + _limit(time_limit_s), solver="ipm" if interior else "simplex",
             run_crossover="off" if interior else "on", objective_bound=math.inf if cutoff is None else cutoff,
             simplex_iteration_limit=_NO_LIMIT if iterations is None else int(iterations))
    h.run()
    _read(model, h)


_NO_LIMIT = 2**31 - 1  # HiGHS's largest iteration limit (its default)


def _limit(time_limit_s: float | None) -> float:
    return math.inf if time_limit_s is None else float(time_limit_s)


def _options(h, **options) -> None:
    for key, value in options.items():
        h.setOptionValue(key, value)


def _highs(model, integral: bool):
    """A silent HiGHS holding ``model``'s arrays.

    highspy prints a banner on stdout when a solver is created, from C++
    before any option can be set, so the process's stdout file descriptor is
    pointed at /dev/null for that one call: a plan written to stdout
    (``autotp plan --json -``) must stay clean.
    """
    import highspy
    import numpy as np

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.n_vars, model.n_rows
    lp.col_cost_ = np.asarray(model.cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(model.lower, dtype=np.float64)
    lp.col_upper_ = np.asarray(model.upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(model.row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(model.row_upper, dtype=np.float64)
    lp.offset_ = model.offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.n_vars, model.n_rows
    lp.a_matrix_.start_ = np.asarray(model.starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(model.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(model.row_coef, dtype=np.float64)
    if integral and any(model.integer):
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[b] for b in model.integer]
    h.passModel(lp)
    return h


def _start(h, start: dict) -> None:
    import numpy as np

    h.setSolution(len(start), np.fromiter(start, dtype=np.int32, count=len(start)),
                  np.fromiter(start.values(), dtype=np.float64, count=len(start)))


def _read(model, h) -> None:
    """HiGHS's outcome as pulp named it: ``Optimal`` (``has_solution``: an optimum, or the incumbent a limit
    stopped at), ``Infeasible``, ``Unbounded`` or ``Not Solved``."""
    import highspy

    s = highspy.HighsModelStatus
    status = h.getModelStatus()
    stopped = (s.kTimeLimit, s.kIterationLimit, s.kInterrupt, s.kObjectiveBound, s.kObjectiveTarget)
    info = h.getInfo()
    feasible = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    if status == s.kOptimal:
        model.status, model.has_solution, model.proven = "Optimal", True, True
    elif status == s.kObjectiveBound and not feasible:  # an LP's dual simplex passed its cutoff
        model.status, model.has_solution, model.proven = CUT_OFF, False, False
    elif status in stopped and feasible:
        model.status, model.has_solution, model.proven = "Optimal", True, False
    elif status in (s.kInfeasible, s.kUnboundedOrInfeasible):
        model.status, model.has_solution, model.proven = "Infeasible", False, False
    elif status == s.kUnbounded:
        model.status, model.has_solution, model.proven = "Unbounded", False, False
    else:
        model.status, model.has_solution, model.proven = "Not Solved", False, False
    model.values = list(h.getSolution().col_value) if model.has_solution else None
    model.objective_value = info.objective_function_value if model.has_solution else None


def _cbc(model, integral: bool, time_limit_s: float | None) -> None:
    """CBC through pulp, on a pulp copy of ``model``: the fallback when highspy is missing, or when asked for.

    Run without its feasibility pump (seconds spent before the branching that
    proves the optimum; its other heuristics still run), which does not
    loosen optimality (the gap stays 0).
    """
    import pulp

    lp = pulp.LpProblem("autotp", pulp.LpMinimize)
    xs = [pulp.LpVariable(f"v{i}", lowBound=None if math.isinf(low) else low, upBound=None if math.isinf(up) else up,
                          cat="Integer" if integral and integer else "Continuous")
          for i, (low, up, integer) in enumerate(zip(model.lower, model.upper, model.integer))]
    for r in range(model.n_rows):
        span = range(model.starts[r], model.starts[r + 1])
        expr = pulp.LpAffineExpression([(xs[model.row_index[k]], model.row_coef[k]) for k in span])
        low, up = model.row_lower[r], model.row_upper[r]
        if low == up:
            lp += expr == low, f"r{r}"
            continue
        if not math.isinf(low):
            lp += expr >= low, f"r{r}_low"
        if not math.isinf(up):
            lp += expr <= up, f"r{r}_up"
    lp += pulp.LpAffineExpression([(x, c) for x, c in zip(xs, model.cost) if c]) + model.offset
    warm = integral and time_limit_s is not None and bool(model.start)
    for i, value in (model.start.items() if warm else ()):
        xs[i].setInitialValue(value)
    lp.solve(pulp.PULP_CBC_CMD(msg=False, mip=integral, timeLimit=time_limit_s, threads=1, warmStart=warm,
                               options=["feas off"] if integral else []))
    model.status = pulp.LpStatus[lp.status]
    model.has_solution = model.status == "Optimal"
    model.proven = lp.sol_status == pulp.LpSolutionOptimal
    model.values = [x.varValue or 0.0 for x in xs] if model.has_solution else None
    model.objective_value = pulp.value(lp.objective) if model.has_solution else None
