"""A fixed-seed slice of the fuzzer (benchmarks/fuzz.py runs hundreds): random models, exact on 2 and 3 ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from fuzz import TOLERANCE, run_cases  # noqa: E402

SEEDS = (*range(6), 14)  # 14: a device whose experts no token picks (its backward must still reach the collectives)


@pytest.mark.parametrize("mesh", ["2", "3"])
def test_random_models_and_random_plans_are_exact(mesh):
    results, failures = run_cases(SEEDS, mesh)
    assert not failures, failures
    assert len(results) == 2 * len(SEEDS)
    for seed, kind, plan, err in results:
        assert err["output"] <= TOLERANCE and err["gradient"] <= TOLERANCE, (seed, kind, mesh, err)
    # the random forced plans really differ from the ILP's
    by_seed = {}
    for seed, kind, plan, _ in results:
        by_seed.setdefault(seed, {})[kind] = plan.to_json()
    assert any(p["ilp"] != p["random"] for p in by_seed.values())
