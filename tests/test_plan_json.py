"""A plan survives save and load, and the same inputs give byte-identical JSON, across processes too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import autotp
from autotp.solve.plan import Plan
from helpers import forced_plan

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {examples!r})
import autotp
from helpers import forced_plan
sys.stdout.write(forced_plan("ilp", "gpt", autotp.Mesh("2x2")).to_json())
"""


def test_round_trip(tmp_path):
    plan = forced_plan("ilp", "gpt", autotp.Mesh("2x2"))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.to_json() == plan.to_json()
    assert loaded.parameters == plan.parameters
    assert loaded.mesh == plan.mesh
    assert loaded.fallback_ops == plan.fallback_ops


def test_same_inputs_same_bytes_across_processes():
    first = forced_plan("ilp", "gpt", autotp.Mesh("2x2")).to_json()
    assert forced_plan("ilp", "gpt", autotp.Mesh("2x2")).to_json() == first
    tests = str(Path(__file__).parent)
    examples = str(Path(__file__).parents[1] / "examples")
    other = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests, examples=examples)], capture_output=True, text=True,
                           check=True)
    assert other.stdout == first


def test_contract_fields():
    plan = forced_plan("ilp", "gpt", autotp.Mesh("2x2"))
    from helpers import make_model

    model, _ = make_model("gpt")
    assert set(plan.parameters) == {n for n, _ in model.named_parameters()}
    for placements in plan.parameters.values():
        assert len(placements) == 2
        assert all(p == "R" or (p.startswith("S(") and p.endswith(")")) for p in placements)
    assert "arange" in plan.fallback_ops  # no rule for arange: replicated, and said so
