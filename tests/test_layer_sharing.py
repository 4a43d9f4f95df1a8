"""Identical layers share ILP variables: the problem stops growing with depth, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.errors import SolverError
from autotp.graph.signature import layer_of
from autotp.solve import backends
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors
from conftest import compute_bound_profile
from models import GPT


def gpt(layers: int):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (4, 8))
    return GPT(vocab=64, hidden=32, heads=4, layers=layers, seq=8), (idx, idx)


def plan(layers: int, share: bool, mesh="4", solver="auto"):
    model, inputs = gpt(layers)
    return autotp.plan(model, mesh, inputs, profile=compute_bound_profile(), share_layers=share, solver=solver)


def test_ilp_size_does_not_grow_with_depth():
    # from 3 layers on, the prefetch chain's layers after the first (whose forward follows the embeddings) fold
    # into one run of identical layers, as the gradient chain's do: the ILP is the same size at any depth
    shared = [plan(n, True) for n in (3, 4, 6)]
    assert len({(p.ilp["groups"], p.ilp["variables"], p.ilp["constraints"]) for p in shared}) == 1
    # every block shares one class (block 0 reads the embeddings, but edges are costed per layer)
    assert [p.ilp["shared_layers"] for p in shared] == [3, 4, 6]
    unshared = [plan(n, False) for n in (2, 4)]
    assert unshared[1].ilp["variables"] > unshared[0].ilp["variables"] > shared[0].ilp["variables"]
    assert shared[1].ilp["variables"] < unshared[1].ilp["variables"]


def test_sharing_keeps_the_optimum_of_uniform_layers_and_forces_them_alike():
    shared, unshared = plan(4, True), plan(4, False)
    assert shared.predicted["objective_s"] == pytest.approx(unshared.predicted["objective_s"], rel=1e-9)
    for name in ("q", "k", "v", "proj", "up", "down"):
        layouts = {shared.parameters[f"blocks.{i}.{name}.weight"] for i in range(4)}
        assert len(layouts) == 1, name


class Mixed(nn.Module):
    """A ModuleList whose entries differ in width: no two layers may share a choice."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_layers_of_different_shapes_are_folded_only_with_their_twins():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    shared = autotp.plan(Mixed(), 2, (x,), profile=compute_bound_profile())
    unshared = autotp.plan(Mixed(), 2, (x,), profile=compute_bound_profile(), share_layers=False)
    # layers 1 and 3 are twins; 0 and 2 would be, but layer 0 reads the program's input: they differ
    assert shared.ilp["groups"] < unshared.ilp["groups"] and shared.ilp["shared_layers"] == 2
    assert shared.predicted["objective_s"] >= unshared.predicted["objective_s"] * (1 - 1e-9)
    assert shared.parameters["layers.1.weight"] == shared.parameters["layers.3.weight"]


def test_layer_of_reads_the_first_numbered_module():
    from autotp.graph.opgraph import OpNode

    def node(module):
        return OpNode("n", "op", None, (), {}, (), (), (), False, 0, 0, False, module=module)

    assert layer_of(node("model.layers.12.self_attn.q_proj")) == ("model.layers", 12)
    assert layer_of(node("blocks.3")) == ("blocks", 3)
    assert layer_of(node("model.norm")) is None
    assert layer_of(node(None)) is None


def _run(rank, world, plans):
    model, inputs = gpt(4)
    return [max_errors(model, p, inputs, rank) for p in plans]


def test_a_shared_plan_of_four_layers_runs_exactly():
    p = plan(4, True, mesh="2")
    assert any("S(" in layout[0] for layout in p.parameters.values())
    for errors in spawn(_run, 2, [p])[0] + spawn(_run, 2, [p])[1]:
        assert errors["output"] <= 1e-5 and errors["gradient"] <= 1e-5


def test_cbc_and_highs_agree():
    cbc, highs = plan(2, True, mesh="2x2", solver="cbc"), plan(2, True, mesh="2x2", solver="highs")
    assert cbc.stats["solver"] == "cbc" and highs.stats["solver"] == "highs"
    assert highs.predicted["objective_s"] == pytest.approx(cbc.predicted["objective_s"], rel=1e-6)


def test_unknown_solver_is_named():
    with pytest.raises(SolverError, match="unknown solver 'gurobi'"):
        backends.resolve("gurobi")
