"""Regathering as an ILP choice: keep the shard of an all-gathered input, gather it again in backward, exactly.

* Planning (the GPT test model, mesh 4 with sequence parallelism, H100
  profile): under a limit that the plans without the lever meet only more
  slowly, or not at all, the ILP regathers; the plan says which kinds, its
  step pays the all-gathers again (``predicted["regather_s"]``, in
  ``comm_s``), the objective is still the step time and its memory fits.
* Lowering (4 gloo ranks, 2x2): residual MLP blocks with Megatron's split
  and sequence parallelism on ``tp`` and every weight stored split on
  ``dp`` as well (ZeRO-3), so both kinds gather: with regathering the
  gathered tensors are freed after forward (weak references die), backward
  gathers them again (more all-gathers run), outputs and every gradient
  match the single device, and with dropout on the program gives exactly
  what it gives without regathering; the same with the blocks recomputed.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import autotp
from autotp.errors import MemoryLimitError
from autotp.lower.collectives import Collective, CommCounter
from autotp.report.baselines import sequence_parallel_only
from autotp.runtime.verify import scaled_error, worst_gradient_error
from helpers import activation_bound_gpt, check_exact_with_dropout, dropout_net, made_for_ranks, planned_and_run

TOLERANCE = 1e-5
HIDDEN = 16  # dropout_net's


def test_the_ilp_regathers_when_memory_binds_and_the_plan_says_so():
    model, inputs = activation_bound_gpt()
    mesh = autotp.Mesh("4", links="nvlink")
    # the other levers off (collective matmuls too: they change which plan is fastest, and what it keeps)
    options = dict(profile="h100-hgx", micro_batches=1, recompute=False, optimizer_sharding=False,
                   overlap_tp=False, allow=sequence_parallel_only(32, 0))
    free = autotp.plan(model, mesh, inputs, **options)
    assert free.regather == [] and free.predicted["regather_s"] == 0.0  # without a limit it only costs
    limit = int(free.memory["total"] * 0.9)
    plan = autotp.plan(model, mesh, inputs, memory_limit=limit, **options)
    assert plan.regather, "a limit 10% under the fastest plan's memory made the ILP regather nothing"
    assert plan.memory["total"] <= limit
    p = plan.predicted
    assert p["regather_s"] > 0
    assert p["objective_s"] == pytest.approx(p["total_s"], rel=1e-8)  # to the solver's tolerance on its rows
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert "gathered again in backward" in plan.summary()
    assert autotp.Plan.from_dict(plan.to_dict()).regather == plan.regather
    try:  # without the lever the same limit costs more, or cannot be met
        without = autotp.plan(model, mesh, inputs, memory_limit=limit, regather=False, **options)
        assert without.predicted["total_s"] > p["total_s"]
    except MemoryLimitError:
        pass


def _make(p: float):
    return dropout_net(p, seq=8)


def _plans(mesh) -> dict:
    """Megatron's split with sequence parallelism on tp, each weight split on dp too: both kinds all-gather."""
    model, inputs = _make(0.0)
    pins = {}
    for i in range(2):
        pins |= {f"blocks.{i}.up.weight": ("S(1)", "S(0)"), f"blocks.{i}.up.bias": ("S(0)", "S(0)"),
                 f"blocks.{i}.down.weight": ("S(0)", "S(1)")}
    base = autotp.plan(model, mesh, inputs, profile="h100-hgx", pin=pins, allow=sequence_parallel_only(HIDDEN, 1),
                       memory_limit=None, micro_batches=1)
    out = {}
    for name, regather, recompute in (("kept", [], []), ("regathered", ["weights", "activations"], []),
                                      ("kept, recomputed", [], ["blocks.0", "blocks.1"]),
                                      ("regathered, recomputed", ["weights", "activations"], ["blocks.0", "blocks.1"])):
        data = base.to_dict()  # every collective a module of its own (tests/test_collective_matmul.py: as rings)
        out[name] = autotp.Plan.from_dict({**data, "regather": regather, "recompute": recompute,
                                           "runtime": {**data["runtime"], "overlap_tp": False}})
    return out


def _gathered_after_forward(local, inputs) -> tuple[torch.Tensor, int]:
    """The loss, and how many tensors the all-gathers returned are still alive after forward."""
    refs, handles = [], []
    for module in local.modules():
        if isinstance(module, Collective) and module.kind.startswith("all_gather"):
            handles.append(module.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out))))
    loss = local(*inputs)
    for h in handles:
        h.remove()
    gc.collect()
    return loss, sum(r() is not None for r in refs)


def _ready(plans, world):
    """Per plan, the two models its ranks lower (without dropout and with it), with their captures."""
    return {name: [made_for_ranks(lambda p=p: _make(p)[0], plan, world) for p in (0.0, 0.3)]
            for name, plan in plans.items()}


def _run(rank, world, plans, ready):
    out, noisy_runs = {}, {}
    for name, plan in plans.items():
        (model, captured), (dropping, captured_dropping) = ready[name]
        inputs = _make(0.0)[1]
        reference = _make(0.0)[0]
        counter = CommCounter()
        local = autotp.parallelize(model, plan, counter=counter, captured=captured)
        want = reference(*inputs)
        got, alive = _gathered_after_forward(local, inputs)
        forward = counter.by_kind().get("all_gather", 0)
        want.backward()
        got.backward()
        noisy = autotp.parallelize(dropping, plan, captured=captured_dropping)
        torch.manual_seed(7)
        loss = noisy(*inputs)
        loss.backward()
        out[name] = {"output": scaled_error(got, want), "gradient": worst_gradient_error(local, reference, plan, rank),
                     "alive": alive, "forward_gathers": forward, "gathers": counter.by_kind().get("all_gather", 0),
                     "regathering": sum(isinstance(m, Collective) and m.regather for m in local.modules()),
                     "dropout_drew": abs(float(loss.detach()) - float(got.detach())) > 1e-3}
        noisy_runs[name] = loss.detach(), {n: p.grad.clone() for n, p in noisy.named_parameters()}
    for name, ((loss, grads), (want, wanted)) in {
            name: (run, noisy_runs[name.replace("regathered", "kept")]) for name, run in noisy_runs.items()}.items():
        out[name]["same_with_dropout"] = torch.equal(loss, want) and all(torch.equal(g, wanted[n])
                                                                         for n, g in grads.items())
    return out


@pytest.fixture(scope="module")
def results():
    mesh = autotp.Mesh("2x2", names=("dp", "tp"))  # the roles the plans give them
    return planned_and_run(_run, _plans, mesh, _ready)


def test_regathered_inputs_are_freed_after_forward_gathered_again_and_exact(results):
    plans, per_rank = results
    kept = plans["kept"]
    assert kept.parameters["blocks.0.up.weight"] == ("S(1)", "S(0)")
    assert {c["axis"] for c in kept.collectives if c["kind"] == "all_gather"} == {"dp", "tp"}  # weights, activations
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            where = f"{name}, rank {rank}"
            check_exact_with_dropout(e, where, TOLERANCE)
        for recomputed in ("", ", recomputed"):
            kept, again = by_plan["kept" + recomputed], by_plan["regathered" + recomputed]
            where = f"rank {rank}{recomputed}"
            assert again["regathering"] > 0 and kept["regathering"] == 0, where
            # what the regathering all-gathers return is freed after forward; kept, it lives until backward
            assert again["alive"] == 0 < kept["alive"], f"{where}: {again['alive']} gathered tensors outlived forward"
            # backward gathers again: the same all-gathers forward, more in all
            assert again["forward_gathers"] == kept["forward_gathers"] > 0, where
            assert again["gathers"] > kept["gathers"], where
            # with dropout: exactly the program without regathering, from the same seed
            assert again["same_with_dropout"], where
