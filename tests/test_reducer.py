"""Data parallelism as DDP runs it: each rank's own batch in, its own outputs out, gradients summed in buckets.

On real gloo groups (meshes 2 and 2x2), for the GPT test model (which returns
its loss) and the MLP (which returns its batch of outputs), planned data
parallel:

* the lowered graph holds no gradient all-reduce: every parameter's sum runs
  in the reducer's buckets (DDP's 25 MiB by default; one per parameter when
  the cap is tiny), and the backward pass issues exactly one collective per
  bucket and step of its sum besides the plan's other backward collectives;
* called with the whole batch or with this rank's rows only
  (`autotp.runtime.local_inputs`), outputs are this rank's piece of the
  single-device outputs (the loss one scalar) and every gradient is the
  single-device gradient's piece, to 1e-5;
* two backward passes accumulate into ``.grad`` as on one device.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.lower import shard_tensor
from autotp.lower.collectives import CommCounter
from autotp.lower.rewrite import parameter_aliases
from autotp.placement import parse_layout
from autotp.runtime import local_inputs, spawn
from autotp.runtime.verify import scaled_error
from helpers import forced_plan, make_model

TOLERANCE = 1e-5


def _outputs(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _errors(plan, rank, name, local_batch: bool, passes: int) -> dict:
    """One rank: ``passes`` forward/backward passes against one device's, outputs and accumulated gradients."""
    model, inputs = make_model(name)
    reference = copy.deepcopy(model)
    counter = CommCounter()
    local = autotp.parallelize(model, plan, counter=counter)
    given = local_inputs(plan, rank, inputs)[0] if local_batch else inputs
    coords, shape = plan.mesh.coords(rank), plan.mesh.shape
    worst = 0.0
    for _ in range(passes):
        want, got = _outputs(reference(*inputs)), _outputs(local(*given))
        for w, g, layout in zip(want, got, plan.io["outputs"]):
            worst = max(worst, scaled_error(g, shard_tensor(w, parse_layout(layout), shape, coords)))
        sum(t.sum() for t in want).backward()
        counter.clear()  # count the backward pass alone
        sum(t.sum() for t in got).backward()
    ref = dict(reference.named_parameters())
    grads = [scaled_error(param.grad, shard_tensor(ref[names[0]].grad, parse_layout(plan.parameters[names[0]]),
                                                   shape, coords))
             for names, param in parameter_aliases(local)]
    buckets = local.autotp_reducer.buckets
    steps = sum(len(b.unit) for b in buckets)
    return {"output": worst, "gradient": max(grads), "grads": len(grads), "buckets": len(buckets),
            "entries": len(local.autotp_reducer.entries), "steps": steps, "calls": counter.count,
            "in_graph": "grad_all_reduce" in local.code}


def _run(rank, world, cases):
    return {key: _errors(plan, rank, *key[1:]) for key, plan in cases.items()}


@pytest.fixture(scope="module", params=["2", "2x2"])
def results(request):
    mesh = autotp.Mesh(request.param)
    plans = {"default": forced_plan("data_parallel", "gpt", mesh),
             "tiny buckets": forced_plan("data_parallel", "gpt", mesh, bucket_cap_mb=1e-4),
             "mlp": forced_plan("data_parallel", "mlp", mesh)}
    cases = {("default", "gpt", False, 1): plans["default"], ("default", "gpt", True, 1): plans["default"],
             ("default", "gpt", False, 2): plans["default"], ("tiny buckets", "gpt", True, 1): plans["tiny buckets"],
             ("mlp", "mlp", True, 1): plans["mlp"], ("mlp", "mlp", False, 1): plans["mlp"]}
    return mesh, plans, spawn(_run, mesh.size, cases)


def test_every_way_of_calling_is_exact(results):
    mesh, _, per_rank = results
    for rank, by_case in enumerate(per_rank):
        for key, e in by_case.items():
            where = f"{key} on {mesh}, rank {rank}"
            assert e["output"] <= TOLERANCE, f"{where}: output error {e['output']:.2e}"
            assert e["gradient"] <= TOLERANCE, f"{where}: gradient error {e['gradient']:.2e}"
            assert e["grads"] == e["entries"] > 0, where


def test_gradient_sums_run_in_buckets_not_in_the_graph(results):
    mesh, plans, per_rank = results
    first = per_rank[0]
    default, tiny = first["default", "gpt", False, 1], first["tiny buckets", "gpt", True, 1]
    assert not default["in_graph"] and not tiny["in_graph"]
    # the GPT's 37 gradients (0.1 MiB) fit one bucket per kind of sum; a tiny cap gives each its own
    assert default["buckets"] == 1 and tiny["buckets"] == tiny["entries"] == 37
    for e, plan in ((default, plans["default"]), (tiny, plans["tiny buckets"]), (first["mlp", "mlp", True, 1],
                                                                              plans["mlp"])):
        # in backward: one collective per bucket and step of its sum, and the plan's other backward collectives
        others = sum(1 for c in plan.collectives if c["phase"] == "backward" and not c.get("bucketed"))
        assert e["calls"] == e["steps"] + others, e
    # outputs stay split by batch, as with DDP; the loss comes back as one scalar
    assert plans["mlp"].io["outputs"] == [("S(0)",) * mesh.ndim] and plans["default"].io["outputs"] == [
        ("R",) * mesh.ndim]


def test_a_wrongly_shaped_input_names_both_shapes_it_takes():
    model, inputs = make_model("mlp")
    plan = forced_plan("data_parallel", "mlp", autotp.Mesh("2"))
    local = autotp.parallelize(model, plan, rank=0, groups={})
    with pytest.raises(autotp.errors.PlanError, match=r"whole \[8, 16\] or as this rank's piece \[4, 16\]"):
        local(torch.randn(6, 16))
