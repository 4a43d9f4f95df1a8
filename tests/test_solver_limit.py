"""A solver time limit: the best plan found, a warning with an honest optimality gap, or a clear error."""

from __future__ import annotations

import math
import re

import pytest

import autotp
from autotp.errors import SolverError, SolverGapWarning
from autotp.solve.gap import optimality_gap
from conftest import compute_bound_profile
from helpers import make_model

MESH = "2x2"
LIMIT_S = 0.001  # both solvers stop at their first clock check, holding only the warm start


@pytest.fixture(scope="module")
def optimal():
    model, inputs = make_model("mlp")
    return autotp.plan(model, autotp.Mesh(MESH), inputs, profile=compute_bound_profile())


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_time_limit_returns_a_complete_plan_and_its_gap(optimal, solver):
    model, inputs = make_model("mlp")
    with pytest.warns(SolverGapWarning, match=r"time limit: the plan is the best found, within .*raise time_limit_s") \
            as caught:
        limited = autotp.plan(model, autotp.Mesh(MESH), inputs, profile=compute_bound_profile(),
                              time_limit_s=LIMIT_S, solver=solver)
    gap = limited.stats["gap"]
    message = next(str(w.message) for w in caught if w.category is SolverGapWarning)
    stated = float(re.search(r"= (\d\.\d{4})\)", message).group(1))
    assert 0 < gap <= 1 and stated == pytest.approx(gap, abs=1e-4)
    assert set(limited.nodes) == set(optimal.nodes) and set(limited.parameters) == set(optimal.parameters)
    incumbent, best = limited.predicted["objective_s"], optimal.predicted["objective_s"]
    assert incumbent >= best * (1 - 1e-9)  # never better than the optimum
    assert incumbent * (1 - gap) <= best * (1 + 1e-6)  # the bound behind the gap is a true lower bound
    assert optimal.stats["gap"] == 0.0


def test_no_plan_within_the_limit_is_an_error(optimal):
    """A memory limit just under the fastest plan's own rules it out and the replicated warm start too, so the
    ILP runs under the limit, and CBC stopped at once there (it is still reading the problem) holds no plan."""
    model, inputs = make_model("mlp")
    with pytest.raises(SolverError, match=r"no plan within time_limit_s=0\.001 s: raise the time limit"):
        autotp.plan(model, autotp.Mesh(MESH), inputs, profile=compute_bound_profile(), time_limit_s=LIMIT_S,
                    memory_limit=optimal.memory["total"] - 1, solver="cbc")


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_a_plan_found_within_the_limit_fits_it(optimal, solver):
    """Given time, the same limit gives a plan that fits it, no faster than the unlimited optimum."""
    model, inputs = make_model("mlp")
    limit = optimal.memory["total"] - 1
    limited = autotp.plan(model, autotp.Mesh(MESH), inputs, profile=compute_bound_profile(), time_limit_s=30,
                          memory_limit=limit, solver=solver)
    assert limited.memory["total"] <= limit and limited.predicted["total_s"] >= optimal.predicted["total_s"]


def test_gap_is_relative_to_the_plan():
    assert optimality_gap(10.0, 7.5) == pytest.approx(0.25)
    assert optimality_gap(10.0, 10.0 + 1e-12) == 0.0  # a bound a rounding error above the plan
    assert math.isnan(optimality_gap(10.0, None))
