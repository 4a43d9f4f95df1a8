"""The ILP's array model (`autotp.solve.linear`) and its two solvers, on problems small enough to check by hand.

* Rows keep their constants and merge a variable named twice; HiGHS and
  CBC reach the same optimum of a small knapsack, the one enumeration finds.
* An LP relaxation's bound with a cutoff (a 300-item packing problem): the
  cutoff itself when the optimum is above it (the dual simplex stopped
  early), the optimum when below; bounds changed between relaxations reach
  the solver that kept its basis.
* An iteration budget stops the simplex where it says, and the next solve
  goes on from that basis; a relaxation not settled within its quick budget
  asks whether it can fit at all, and believes the answer.
"""

from __future__ import annotations

import random
from itertools import product

import pytest

from autotp.solve import backends
from autotp.solve.gap import lp_relaxation_bound
from autotp.solve.linear import Model, total

VALUES, WEIGHTS, CAPACITY = [6.0, 5.0, 4.0, 3.0], [5.0, 4.0, 3.0, 2.0], 9.0


def _knapsack():
    """Maximise value under a capacity: minimise minus the value; one item is named twice in the row."""
    m = Model()
    x = [m.var(binary=True) for _ in VALUES]
    m.le(total(w * v for w, v in zip(WEIGHTS, x)) + 0.5 * x[0] - 0.5 * x[0] + 1.0, CAPACITY + 1.0)
    m.minimise(total(-value * v for value, v in zip(VALUES, x)) + 10.0)
    return m, x


def _best() -> float:
    return min(10.0 - sum(v for v, b in zip(VALUES, bits) if b)
               for bits in product((0, 1), repeat=len(VALUES))
               if sum(w for w, b in zip(WEIGHTS, bits) if b) <= CAPACITY)


SOLVERS = ["cbc", "highs"] if backends.highs_available() else ["cbc"]


@pytest.mark.parametrize("solver", SOLVERS)
def test_both_solvers_find_the_enumerated_optimum(solver):
    m, x = _knapsack()
    assert m.n_rows == 1 and len(m.row_index) == len(VALUES)  # x[0]'s three mentions merged into one entry
    backends.solve_mip(m, solver, None)
    assert m.status == "Optimal" and m.proven
    assert m.objective_value == pytest.approx(_best())
    chosen = [v.value() > 0.5 for v in x]
    assert sum(w for w, c in zip(WEIGHTS, chosen) if c) <= CAPACITY


def _packing(seed: int = 0, n: int = 300):
    """300 items under 30 overlapping capacities: big enough that HiGHS's dual simplex iterates towards its bound."""
    rng = random.Random(seed)
    m = Model()
    x = [m.var(binary=True) for _ in range(n)]
    value, weight = [rng.uniform(1, 10) for _ in range(n)], [rng.uniform(1, 10) for _ in range(n)]
    for _ in range(30):
        m.le(total(weight[i] * x[i] for i in rng.sample(range(n), 40)), 60.0)
    m.minimise(total(-value[i] * x[i] for i in range(n)))
    return m, x


@pytest.mark.skipif(not backends.highs_available(), reason="the cutoff is HiGHS's dual simplex bound")
def test_a_relaxation_with_a_cutoff_stops_there_or_gives_its_optimum():
    m, x = _packing()
    optimum = lp_relaxation_bound(m)
    assert optimum is not None
    m.relaxed = None  # a cold start, as a relaxation met first
    assert lp_relaxation_bound(m, cutoff=optimum - 100.0) == optimum - 100.0 and m.status == backends.CUT_OFF
    assert lp_relaxation_bound(m, cutoff=optimum + 1.0) == pytest.approx(optimum)  # below its cutoff: the optimum
    # bounds changed between relaxations reach the solver that kept its basis
    pinned = max(range(len(x)), key=lambda i: x[i].value())
    m.set_bounds(x[pinned].index, 0.0, 0.0)
    assert lp_relaxation_bound(m) > optimum
    m.set_bounds(x[pinned].index, 0.0, 1.0)
    assert lp_relaxation_bound(m) == pytest.approx(optimum)


@pytest.mark.skipif(not backends.highs_available(), reason="iteration budgets are HiGHS's simplex limit")
def test_an_iteration_budget_stops_the_simplex_and_the_next_solve_goes_on_from_its_basis():
    m, _ = _packing(seed=1)
    whole, _ = _packing(seed=1)
    backends.solve_lp(whole, None)
    needed = whole.relaxed.getInfo().simplex_iteration_count
    assert needed > 20
    backends.solve_lp(m, None, iterations=needed // 4)
    assert m.status == "Not Solved" and not m.proven
    assert m.relaxed.getInfo().simplex_iteration_count == needed // 4
    backends.solve_lp(m, None)  # no budget: it settles, from the basis it stopped at
    assert m.status == "Optimal" and m.proven
    assert m.objective_value == pytest.approx(whole.objective_value)
    assert m.relaxed.getInfo().simplex_iteration_count < needed


@pytest.mark.skipif(not backends.highs_available(), reason="the quick check follows HiGHS's iteration budget")
def test_a_relaxation_not_settled_within_its_quick_budget_asks_infeasible_and_believes_it(monkeypatch):
    from autotp.solve import gap

    m, _ = _packing(seed=2)
    optimum = lp_relaxation_bound(m)
    asked = []
    monkeypatch.setattr(gap, "SIMPLEX_QUICK_ITERATIONS", 5)
    m.relaxed = None
    assert lp_relaxation_bound(m, infeasible=lambda: asked.append(1) or False) == pytest.approx(optimum)
    assert asked == [1]  # asked once, said "may fit": the simplex went on to the optimum
    m.relaxed = None
    assert lp_relaxation_bound(m, infeasible=lambda: True) is None and m.status == "Infeasible"
    monkeypatch.setattr(gap, "SIMPLEX_QUICK_ITERATIONS", 10**6)
    m.relaxed = None
    assert lp_relaxation_bound(m, infeasible=lambda: pytest.fail("settled within its budget")) == pytest.approx(optimum)
