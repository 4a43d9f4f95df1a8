"""The rank module under ``torch.compile(fullgraph=True)`` (issue 17): one graph, forward and backward exact.

On 4 gloo processes (mesh 4), the test GPT under the ILP's plan (its
collective matmuls included: under compilation their rings of point-to-point
sends become one collective beside the matmul, `autotp.lower.collective_matmul`)
and the dropout net with dropout on (p = 0.3, its dropout split and drawn
whole, `autotp.lower.random_ops`) are compiled with ``fullgraph=True``, so any
graph break is an error, with the ``aot_eager`` backend: Dynamo and AOTAutograd
trace the collectives and the backward as Inductor would, without its C++
build (about 40 s a rank here; benchmarks/runtime.py times Inductor). Each
rank's loss and every gradient match the single device's to 1e-5, dropout's
from the same seed.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.lower.collective_matmul import GatherMatmul, MatmulScatter
from autotp.runtime import spawn
from autotp.runtime.verify import scaled_error, worst_gradient_error
from conftest import compute_bound_profile
from helpers import dropout_net, made_for_ranks, make_model

TOLERANCE = 1e-5
MODELS = {"gpt": lambda: make_model("gpt"), "dropout_net": lambda: dropout_net(0.3, seq=8)}


def _run(rank, world, plans, made):
    out = {}
    for name, plan in plans.items():
        model, captured = made[name]
        inputs = MODELS[name]()[1]
        reference = MODELS[name]()[0]
        torch.manual_seed(7)
        want = reference(*inputs)
        want.backward()
        local = autotp.parallelize(model, plan, captured=captured)
        compiled = torch.compile(local, fullgraph=True, backend="aot_eager")
        torch.manual_seed(7)
        got = compiled(*inputs)
        got.backward()
        rings = sum(isinstance(m, (GatherMatmul, MatmulScatter)) for m in local.modules())
        out[name] = {"output": scaled_error(got, want), "gradient": worst_gradient_error(local, reference, plan, rank),
                     "rings": rings}
    return out


@pytest.fixture(scope="module")
def results():
    mesh = autotp.Mesh("4")
    plans = {name: autotp.plan(make()[0], mesh, make()[1], profile=compute_bound_profile())
             for name, make in MODELS.items()}
    made = {name: made_for_ranks(lambda make=make: make()[0], plans[name], mesh.size) for name, make in MODELS.items()}
    return plans, spawn(_run, mesh.size, plans, made)


def test_compiled_rank_modules_are_one_graph_and_exact(results):
    plans, per_rank = results
    assert any(p.startswith("S(") for layout in plans["gpt"].parameters.values() for p in layout), "nothing split"
    assert plans["dropout_net"].nodes["dropout"].out != ("R",), "the dropout is not split: it would prove less"
    for rank, by_model in enumerate(per_rank):
        assert by_model["gpt"]["rings"] > 0, "no collective matmul in the GPT's program: the fallback is untested"
        for name, e in by_model.items():
            assert e["output"] <= TOLERANCE and e["gradient"] <= TOLERANCE, (rank, name, e)
