"""End to end on real gloo process groups: outputs and every parameter gradient match one device.

Each mesh runs one group of processes for all its cases: the ILP's plan and
the forced plans (all-replicated, data-parallel, Megatron column/row), on the
MLP and the GPT, so lowering is tested independently of what the solver picks.
"""

from __future__ import annotations

import pytest

import autotp
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors
from helpers import forced_plan, made_for_ranks, make_model

PLANS = ("ilp", "replicated", "data_parallel", "megatron")
MODELS = ("mlp", "gpt")
TOLERANCE = 1e-5


def _run_cases(rank, world, cases, made):
    return [(name, kind, max_errors(model, plan, make_model(name)[1], rank, captured=captured))
            for (name, kind, plan), (model, captured) in zip(cases, made)]


@pytest.fixture(scope="module", params=["2", "4", "2x2"])
def mesh_results(request):
    mesh = autotp.Mesh(request.param)
    cases = [(name, kind, forced_plan(kind, name, mesh)) for name in MODELS for kind in PLANS]
    made = [made_for_ranks(lambda name=name: make_model(name)[0], plan, mesh.size) for name, _, plan in cases]
    return mesh, cases, spawn(_run_cases, mesh.size, cases, made)


def test_outputs_and_gradients_match_single_device(mesh_results):
    mesh, cases, per_rank = mesh_results
    for rank, results in enumerate(per_rank):
        for name, kind, errors in results:
            where = f"{name} / {kind} plan on {mesh}, rank {rank}"
            assert errors["output"] <= TOLERANCE, f"{where}: output error {errors['output']:.2e}"
            assert errors["gradient"] <= TOLERANCE, f"{where}: gradient error {errors['gradient']:.2e}"
            model, _ = make_model(name)
            assert errors["parameters"] == len(list(model.parameters())), where


def test_forced_plans_really_split(mesh_results):
    """The forced plans must be what they claim, or the exactness test above proves less."""
    mesh, cases, _ = mesh_results
    by_kind = {(name, kind): plan for name, kind, plan in cases}
    tp = mesh.ndim - 1
    for name in MODELS:
        assert all(p == ("R",) * mesh.ndim for p in by_kind[name, "replicated"].parameters.values())
        assert not by_kind[name, "replicated"].collectives
        dp = by_kind[name, "data_parallel"]
        assert all(p == ("R",) * mesh.ndim for p in dp.parameters.values())
        assert any(c["kind"] == "all_reduce" and c["phase"] == "backward" for c in dp.collectives)
        mega = by_kind[name, "megatron"].parameters
        first = "fc1.weight" if name == "mlp" else "blocks.0.up.weight"
        second = "fc2.weight" if name == "mlp" else "blocks.0.down.weight"
        assert mega[first][tp] == "S(0)" and mega[second][tp] == "S(1)"
        ilp = by_kind[name, "ilp"]
        assert any("S(" in p for layout in ilp.parameters.values() for p in layout) or any(
            "S(" in p for n in ilp.nodes.values() for p in n.out), "the ILP plan should split something"
