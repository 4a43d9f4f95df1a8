"""Micro-batches: the example batch is one optimizer step's; the planner may run it in k pieces, exactly.

* Planning (the GPT test model, batch 16, mesh 4, H100 profile): without a
  binding limit the step is one batch; under a limit that only smaller
  micro-batches meet, the plan runs k > 1 micro-batches, records k and the
  micro-batch's inputs, pays its compute and collectives k times and the
  gradient sums once (ZeRO-2's after every micro-batch), and its objective is still its step time. A k that
  does not divide the batch is a clear error.
* On 2x2 gloo, `autotp.runtime.accumulate` runs a step's batch of 16 as the
  plan's micro-batches: under a data-parallel plan of 4 micro-batches (the
  reducer sums once, after the last), and under the ILP's plan with every
  lever at once (2 micro-batches, both blocks recomputed, optimizer state
  and gradients split: ZeRO-2): every gradient matches the single device's on the whole batch,
  and three AdamW steps give its losses, to 1e-5. ZeRO-2's gradients are
  reduce-scattered after every micro-batch and only their slices accumulate
  (no whole gradient outlives a backward pass); the others are summed once,
  and accumulate in their buckets (``.grad`` a view of the bucket, as DDP's
  ``gradient_as_bucket_view``), so the gradients are never held twice.
  The rank module accepts ``train()``, its plan's mode, and refuses
  ``eval()`` with an error that says to plan for inference.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import autotp
from autotp.errors import MemoryLimitError, PlanError
from autotp.lower.collectives import CommCounter
from autotp.report.baselines import batch_split_only
from autotp.runtime import accumulate, local_tensor, shard_optimizer
from autotp.runtime.verify import worst_gradient_error
from conftest import compute_bound_profile
from helpers import made_for_ranks, planned_and_run, recomputed_stretches, split_optimizer_where_whole
from models import GPT

TOLERANCE = 1e-5
BATCH = 16


def _make():
    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    return model, (torch.randint(0, 64, (BATCH, 8)), torch.randint(0, 64, (BATCH, 8)))


def test_micro_batches_are_planned_when_memory_needs_them():
    model, inputs = _make()
    mesh = autotp.Mesh("4", links="nvlink")
    free = autotp.plan(model, mesh, inputs, profile="h100-hgx")
    assert free.micro_batches == 1
    tight = autotp.plan(model, mesh, inputs, profile="h100-hgx", memory_limit=int(free.memory["total"] * 0.15))
    k = tight.micro_batches
    assert k > 1 and tight.inputs["args"][0]["shape"] == [BATCH // k, 8]
    assert tight.memory["total"] <= free.memory["total"] * 0.15
    p = tight.predicted
    assert p["objective_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert autotp.Plan.from_dict(tight.to_dict()).micro_batches == k
    # the search over k (one micro-batch far over the limit: the likeliest count searched first) finds the fastest
    # of the plans each k gives alone
    alone = []
    for count in (1, 2, 4, 8, 16):
        try:
            alone.append(autotp.plan(model, mesh, inputs, profile="h100-hgx", micro_batches=count,
                                     memory_limit=int(free.memory["total"] * 0.15)).predicted["total_s"])
        except MemoryLimitError:
            pass
    assert p["total_s"] == pytest.approx(min(alone), rel=1e-9)
    two = autotp.plan(model, mesh, inputs, profile="h100-hgx", micro_batches=2, recompute=False,
                      optimizer_sharding=False)
    assert two.micro_batches == 2 and two.predicted["total_s"] > free.predicted["total_s"]
    with pytest.raises(PlanError, match="a batch of 16 does not split into 3 micro-batches.*1, 2, 4, 8, 16"):
        autotp.plan(model, mesh, inputs, profile="h100-hgx", micro_batches=3)


def _plans(mesh) -> dict:
    model, inputs = _make()
    profile = compute_bound_profile()
    split = split_optimizer_where_whole(mesh.shape, gradients=True)
    data_parallel = autotp.plan(model, mesh, inputs, profile=profile, micro_batches=4,
                                allow=lambda op, s: batch_split_only(BATCH // 4)(op, replace(s, optimizer_axes=())))
    combined = autotp.plan(model, mesh, inputs, profile=profile, micro_batches=2, allow=split)
    combined.recompute = ["blocks.0", "blocks.1"]  # the lowering checkpoints whatever the plan names
    return {"data_parallel": data_parallel, "combined": combined}


def _run(rank, world, plans, made):
    out = {}
    for name, plan in plans.items():
        (model, captured), inputs = made[name], _make()[1]
        reference = copy.deepcopy(model)
        counter = CommCounter()
        local = autotp.parallelize(model, plan, counter=counter, captured=captured)
        assert local.train() is local and local.training  # the plan's own mode: a no-op, as a training loop calls it
        try:
            local.eval()
            refused = ""
        except PlanError as exc:  # a captured program cannot change mode: the error says how to get the other
            refused = str(exc)
        want = reference(*inputs)
        want.backward()
        got = accumulate(local, plan, *inputs)
        gradient = worst_gradient_error(local, reference, plan, rank)
        reducer = local.autotp_reducer
        buckets = reducer.buckets if reducer is not None else []
        sums = sum(len(b.unit) for b in buckets if b.slices == 1)  # summed once a step
        # ZeRO-2's, every micro-batch: its steps and the all-gather of its slices back (no split optimizer yet)
        sliced_sums = sum(len(b.unit) + 1 for b in buckets if b.slices > 1)
        calls = counter.count
        optimizers = [torch.optim.AdamW(reference.parameters(), lr=1e-2), shard_optimizer(local, torch.optim.AdamW,
                                                                                          lr=1e-2)]
        losses = [(float(want), float(got))]
        for step in range(3):
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            torch.manual_seed(100 + step)
            batch = (torch.randint(0, 64, (BATCH, 8)), torch.randint(0, 64, (BATCH, 8)))
            want = reference(*batch)
            want.backward()
            losses.append((float(want), float(accumulate(local, plan, *batch))))
        # with the split optimizer attached, a micro-batch's backward leaves ZeRO-2 gradients only as slices
        optimizers[1].zero_grad()  # drops the last step's slices
        for p in local.parameters():
            p.grad = None
        with reducer.no_sync():
            micro = [t[:BATCH // plan.micro_batches] for t in inputs]
            local(*micro).backward()
        sliced = [p for b in buckets if b.slices > 1 for p in (e.param for e in b.entries)]
        # the others' partial gradients accumulate in their bucket's slots: .grad is a view, not a second copy
        held = [(p, b) for b in buckets if b.slices == 1 for p in (e.param for e in b.entries)]
        in_bucket = sum(p.grad is not None and b.data is not None
                        and local_tensor(p.grad).untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
                        for p, b in held)
        whole_left = sum(p.grad is not None for p in sliced)
        slices_held = sum(getattr(p, "autotp_gradient_slice", None) is not None for p in sliced)
        out[name] = {"gradient": gradient, "losses": losses, "calls": calls, "sums": sums, "sliced_sums": sliced_sums,
                     "sliced": len(sliced), "whole_left": whole_left, "slices_held": slices_held,
                     "held": len(held), "in_bucket": in_bucket, "refused": refused,
                     "split": len(local.autotp_optimizer_shards),
                     "recomputed": recomputed_stretches(local)}
    return out


@pytest.fixture(scope="module")
def results():
    return planned_and_run(_run, _plans, autotp.Mesh("2x2"),
                           lambda plans, world: {name: made_for_ranks(lambda: _make()[0], plan, world)
                                                 for name, plan in plans.items()})


def test_a_step_of_micro_batches_matches_the_whole_batch_on_one_device(results):
    plans, per_rank = results
    dp, combined = plans["data_parallel"], plans["combined"]
    assert dp.micro_batches == 4 and dp.inputs["args"][0]["shape"] == [4, 8]
    assert combined.micro_batches == 2 and combined.optimizer_sharding and combined.gradient_sharding
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            where = f"{name}, rank {rank}"
            assert e["gradient"] <= TOLERANCE, f"{where}: gradient error {e['gradient']:.2e}"
            for step, (want, got) in enumerate(e["losses"]):
                assert abs(want - got) <= TOLERANCE * max(1.0, abs(want)), f"{where}: step {step}: {got} != {want}"
        # every collective of the program ran once per micro-batch, the gradient sums in buckets once, after the
        # last micro-batch, except ZeRO-2's, after each
        for name, plan in plans.items():
            e, k = by_plan[name], plan.micro_batches
            in_graph = sum(1 for c in plan.collectives if not c.get("bucketed") and c["phase"] != "step")
            assert e["sums"] + e["sliced_sums"] > 0, name
            assert e["calls"] == k * in_graph + e["sums"] + k * e["sliced_sums"], (name, e, in_graph)
            assert e["whole_left"] == 0 and e["slices_held"] == e["sliced"], name
            assert e["in_bucket"] == e["held"], name  # a no_sync pass's gradients live in the buckets only
        assert by_plan["data_parallel"]["held"] > 0
        assert all("plan with autotp.plan(..., training=False)" in e["refused"] for e in by_plan.values())
        assert by_plan["combined"]["split"] > 0 and by_plan["combined"]["recomputed"] >= 2
        assert by_plan["combined"]["sliced"] > 0
