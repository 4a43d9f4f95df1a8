"""Reduced-cost fixing: the columns an LP relaxation proves cannot be 1 in any plan faster than one in hand.

At an optimal basis of a minimisation's LP relaxation, of optimum ``L``,
every feasible point costs at least ``L + d_j x_j`` for each column ``j``
at its lower bound 0 with reduced cost ``d_j >= 0`` (the other reduced costs
and the row duals only add to it, by their signs at the optimum). So a
column that is 0 or 1 in every plan worth finding (``Model.zero_one``: a
binary, an edge's pair of choices, a fan-out item) with ``L + d_j`` above
the objective a search must beat (its cutoff) is 0 in every such plan, and
the MIP is handed it fixed to 0.

That is what HiGHS itself does after its root node, but only once its
presolve has read the whole problem: on Llama-2-70B's ILP on 4x8 under the
memory limit (43,000 columns, 2,300 binaries) presolve took 3.3 of the MIP's
4.4 s. The branches of `autotp.solve.ilp._limited` solve each relaxation
anyway to bound it, so their duals come free, and with a third of the
binaries fixed before it starts the same MIP is proven in 1.2 s (2.4 s
when the cutoff is the 2.7% worse plan rounded from the relaxation, 1.1 s
when it is the plan completed from the relaxation, 0.04% worse, which fixes
665 binaries rather than 271: `autotp.solve.ilp._completed`).
The pair columns are most of the model (35,800 of Llama-2-70B's 43,000 at
batch 8): fixing them as well as the binaries (23,000 columns rather than
690) took the MIPs of the two sets that tie at batch 8 from 1.15 and 1.2 s
to 0.3 s each, the same optima.
Exact: a fixed column only removes plans no faster than the cutoff, and the
margin absorbs the LP solver's tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass

_MARGIN = 1e-6  # relative: a reduced cost this close to the gap proves nothing within the LP's tolerances


@dataclass(frozen=True)
class Duals:
    """An optimal relaxation's objective and, per 0-or-1 column at 0 in it (``Model.zero_one``), its reduced
    cost."""

    bound: float
    reduced: dict[int, float]


def relaxation_duals(model) -> Duals | None:
    """The duals of ``model``'s last LP relaxation (`autotp.solve.backends.solve_lp`), or None where they prove
    nothing: not solved to optimality by the simplex (an interior point without crossover, a cut-off run, CBC)."""
    h = model.relaxed
    if h is None or model.status != "Optimal" or not model.proven or model.objective_value is None:
        return None
    solution = h.getSolution()
    if not (solution.dual_valid and h.getBasis().valid):
        return None
    values, duals = solution.col_value, solution.col_dual
    reduced = {j: duals[j] for j, zero_one in enumerate(model.zero_one)
               if zero_one and values[j] <= 1e-9 and duals[j] > 0.0}
    return Duals(model.objective_value, reduced)


def fix_beyond(model, duals: Duals | None, cutoff: float | None) -> list[tuple[int, float]]:
    """Fix to 0 every column that ``duals`` prove costs more than ``cutoff`` at 1; returns each with its upper
    bound, for `release`."""
    if duals is None or cutoff is None:
        return []
    slack = cutoff - duals.bound + _MARGIN * max(abs(cutoff), abs(duals.bound), 1.0)
    fixed = [(j, model.upper[j]) for j, d in duals.reduced.items() if d > slack and model.upper[j] > 0.0]
    for j, _ in fixed:
        model.set_bounds(j, model.lower[j], 0.0)
    return fixed


def release(model, fixed: list[tuple[int, float]]) -> None:
    """Undo `fix_beyond`: the model is shared by the branches of one set (`autotp.solve.ilp._limited`)."""
    for j, upper in fixed:
        model.set_bounds(j, model.lower[j], upper)
