"""Activation recomputation as an ILP choice: chosen when memory binds, costed, lowered exactly.

* Planning (the GPT test model on the meta device, mesh 4, H100 profile):
  under a limit no plan of one batch a step meets without it, the ILP
  recomputes the blocks;
  its step pays their forward compute again (``predicted["recompute_s"]``,
  in ``compute_s``), the objective is still the step time, and the memory
  fits; without the lever the same limit is a `MemoryLimitError` that says
  which levers it tried.
* Lowering (2 gloo ranks): a model with dropout, under the ILP's plan and
  under Megatron's split (collectives inside the blocks, so each block is
  checkpointed in several stretches): with dropout off, outputs and every
  gradient match the single device; with dropout on, the recomputed program
  gives exactly what the same program without recomputation gives (the
  masks are drawn again alike).
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.errors import MemoryLimitError, PlanError
from autotp.lower.collectives import CommCounter
from autotp.runtime.verify import scaled_error, worst_gradient_error
from conftest import compute_bound_profile
from helpers import (
    check_exact_with_dropout, dropout_net, make_model, planned_and_run, recomputed_stretches)

TOLERANCE = 1e-5


def test_the_ilp_recomputes_layers_only_when_memory_needs_it():
    model, inputs = make_model("gpt")
    mesh = autotp.Mesh("4", links="nvlink")
    free = autotp.plan(model, mesh, inputs, profile="h100-hgx")
    assert free.recompute == [] and free.predicted["recompute_s"] == 0.0
    limit = int(free.memory["total"] * 0.27)  # below what any plan without recomputation needs
    # (nor regathering, which tests/test_regather.py covers: this is recomputation alone)
    with pytest.raises(MemoryLimitError, match=r"optimizer state and gradients split .*smallest any plan reaches"):
        autotp.plan(model, mesh, inputs, profile="h100-hgx", memory_limit=limit, recompute=False, micro_batches=1,
                    regather=False)
    tight = autotp.plan(model, mesh, inputs, profile="h100-hgx", memory_limit=limit, micro_batches=1,
                        regather=False)
    assert tight.recompute == ["blocks.0", "blocks.1"]
    assert tight.memory["total"] <= limit
    p = tight.predicted
    assert p["recompute_s"] > 0
    assert p["objective_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert "recomputed in backward: blocks.* ×2" in tight.summary()
    assert autotp.Plan.from_dict(tight.to_dict()).recompute == tight.recompute
    # any number of the class's layers: a larger search space, never a slower plan, the same limit met
    layers = autotp.plan(model, mesh, inputs, profile="h100-hgx", memory_limit=limit, micro_batches=1,
                         recompute="layers", regather=False)
    assert layers.memory["total"] <= limit and set(layers.recompute) <= {"blocks.0", "blocks.1"}
    assert layers.predicted["total_s"] <= tight.predicted["total_s"] * (1 + 1e-9)
    with pytest.raises(PlanError, match="recompute='some'.*'layers'"):
        autotp.plan(model, mesh, inputs, profile="h100-hgx", recompute="some")


def _make(p: float):
    return dropout_net(p, seq=6)


def _plans(mesh) -> dict:
    model, inputs = _make(0.0)
    # without collective matmuls, which join a recomputed stretch and run again in backward by design
    # (tests/test_collective_matmul.py): here every collective stays outside the stretches, whichever of the
    # plans that tie under the compute-bound profile the ILP takes
    plans = {"ilp": autotp.plan(model, mesh, inputs, profile=compute_bound_profile(), overlap_tp=False),
             "megatron": autotp.plan(model, mesh, inputs, profile="h100-hgx",
                                     pin={f"blocks.{i}.{name}.{kind}": placement for i in range(2)
                                          for name, kind, placement in (("up", "weight", ("S(0)",)),
                                                                        ("up", "bias", ("S(0)",)),
                                                                        ("down", "weight", ("S(1)",)))})}
    for plan in plans.values():
        plan.recompute = ["blocks.0", "blocks.1"]  # the lowering checkpoints whatever the plan names
    return plans


def _grads(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _run(rank, world, plans):
    out = {}
    for name, plan in plans.items():
        model, inputs = _make(0.0)
        reference = _make(0.0)[0]
        local = autotp.parallelize(model, plan)
        want, got = reference(*inputs), local(*inputs)
        want.backward()
        got.backward()
        gradient = worst_gradient_error(local, reference, plan, rank)
        stretches = recomputed_stretches(local)
        # with dropout: the same rank program with and without recomputation, from the same seed
        dropped, issued = [], []
        for layers in (plan.recompute, []):
            counter = CommCounter()
            noisy = autotp.parallelize(_make(0.3)[0], type(plan).from_dict({**plan.to_dict(), "recompute": layers}),
                                       counter=counter)
            torch.manual_seed(7)
            loss = noisy(*inputs)
            loss.backward()
            dropped.append((loss.detach(), _grads(noisy)))
            issued.append(counter.count)
        same = torch.equal(dropped[0][0], dropped[1][0]) and all(
            torch.equal(dropped[0][1][n], g) for n, g in dropped[1][1].items())
        out[name] = {"output": scaled_error(got, want), "gradient": gradient, "stretches": stretches,
                     "grads": len(dropped[0][1]), "same_with_dropout": same, "collectives": issued,
                     "dropout_drew": abs(float(dropped[0][0]) - float(got)) > 1e-3}
    return out


@pytest.fixture(scope="module")
def results():
    return planned_and_run(_run, _plans, autotp.Mesh("2"))


def test_recomputed_layers_are_exact_and_draw_the_same_dropout_masks(results):
    plans, per_rank = results
    assert any(node.out != ("R",) for node in plans["ilp"].nodes.values())  # the plans really split
    assert plans["megatron"].parameters["blocks.0.up.weight"] == ("S(0)",)
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            where = f"{name}, rank {rank}"
            check_exact_with_dropout(e, where, TOLERANCE)
            assert e["same_with_dropout"], f"{where}: recomputation changed a dropout mask"
            # no collective runs again in backward: each stretch holds ATen ops only
            assert e["collectives"][0] == e["collectives"][1] > 0, f"{where}: {e['collectives']}"
            assert e["grads"] == len(plans[name].parameters)
        # a block's collectives stay outside the checkpointed stretches: Megatron's all-reduce cuts each block
        assert by_plan["megatron"]["stretches"] > by_plan["ilp"]["stretches"] >= 2, by_plan
