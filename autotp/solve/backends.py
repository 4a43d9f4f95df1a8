"""Which MILP solver runs the ILP: HiGHS (``highspy``, a dependency) or CBC (bundled with pulp).

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
8.5, at batch 64 in 7.9 s instead of 16.3). An LP relaxation alone
runs without presolve: HiGHS's dual simplex solves these in about a
second from the raw model, where presolving them first took 3 to 66 s. CBC runs
without its feasibility pump (seconds spent before the branching that
proves the optimum; its other heuristics still run), which does not loosen
optimality (the gap stays 0).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pulp

from autotp.errors import SolverError
from autotp.solve.gap import set_highs_start

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


# HiGHS's presolve rules are bits of ``presolve_rule_off`` in the order of its ``PresolveRuleType``; probing is
# bit 15 from HiGHS 1.13 on (hence highspy>=1.13 in pyproject.toml)
_PROBING = 1 << 15


def command(name: str, time_limit_s: float | None):
    """The pulp solver object for ``name`` (already resolved), single-threaded, silent, exact gap."""
    if name == "highs":
        highs = _QuietHiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=0.0, presolve_rule_off=_PROBING)
        highs.warm_start = time_limit_s is not None  # as CBC's warmStart: see autotp.solve.gap
        return highs
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1, warmStart=time_limit_s is not None,
                             options=["feas off"])


def lp_command(time_limit_s: float | None, interior: bool = False):
    """The solver of an LP relaxation (integrality dropped): HiGHS's simplex when installed, else CBC's.

    HiGHS is the robust one: CBC's simplex has been seen to run for over twenty
    minutes on a relaxation HiGHS solves in seconds (Llama-2-70B at batch 64).
    Without presolve, which costs more than it saves on these LPs (above).
    ``interior``: HiGHS's interior-point method instead, without crossover (the
    optimum's value is all a bound needs), which settles in seconds the
    relaxations the simplex takes minutes over (an infeasible one, in phase 1).
    """
    if highs_available() and interior:
        return _QuietHiGHS(mip=False, msg=False, timeLimit=time_limit_s, threads=1, solver="ipm",
                           run_crossover="off")
    if highs_available():
        return _QuietHiGHS(mip=False, msg=False, timeLimit=time_limit_s, threads=1, presolve="off")
    return pulp.PULP_CBC_CMD(msg=False, mip=False, timeLimit=time_limit_s, threads=1)


class _QuietHiGHS(pulp.HiGHS):
    """pulp's HiGHS, minus the banner highspy prints on stdout when a solver is created.

    The banner comes from C++ before any option can be set, so the process's
    stdout file descriptor is pointed at /dev/null for that one call: a plan
    written to stdout (``autotp plan --json -``) must stay clean.
    """

    warm_start = False

    def callSolver(self, lp):
        if self.warm_start:
            set_highs_start(lp)
        super().callSolver(lp)

    def createAndConfigureSolver(self, lp):
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                super().createAndConfigureSolver(lp)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
