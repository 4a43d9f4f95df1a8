"""ZeRO-1 and 2 as ILP choices: optimizer state (and gradient) split where a parameter is whole, exactly.

* The ILP splits optimizer state only when memory binds (it costs an
  all-gather of the parameter after every step), and the plan's memory,
  step time and collectives say so: the optimizer term is the closed form,
  the objective is the step time, each split parameter has its all-gather.
* ZeRO-2 reduce-scatters a gradient into its optimizer slices: the plan's
  gradient term is the slices, its step no slower than ZeRO-1's, and each
  split parameter has its reduce-scatter in the reducer's buckets.
* The training precision sets the bytes of a parameter's state (Megatron's
  18 bytes a parameter for mixed precision).
* On 2x2 gloo, the GPT test model trained 3 AdamW steps with
  `autotp.runtime.shard_optimizer` gives the single device's losses to 1e-5,
  and the parameters of the same rank program under a plain AdamW, under a
  data-parallel plan whose optimizer state is split over the whole mesh and
  under Megatron's weights with it split over the data-parallel axis, each
  with gradients whole (ZeRO-1) and split (ZeRO-2: each device holds only
  its gradient slices, no ``.grad``), the all-gathers after each step
  waited for by the next forward pass at each parameter's first use; saved with
  `autotp.checkpoint.save_sharded` and resumed, it continues exactly.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

import autotp
from autotp.checkpoint import load_sharded, save_sharded
from autotp.errors import PlanError
from autotp.graph.opgraph import KIND_PARAM
from autotp.placement import parse_layout
from autotp.runtime import shard_optimizer, spawn, wait_parameters
from autotp.runtime.verify import scaled_error
from autotp.report.baselines import batch_split_only
from autotp.solve.constraints import replicated_only
from conftest import compute_bound_profile
from helpers import made_for_ranks, make_model, megatron_pins, split_optimizer_where_whole

TOLERANCE = 1e-5
STEPS = 3


def _gpt_plan(mesh, **options):
    model, inputs = make_model("gpt")
    return autotp.plan(model, mesh, inputs, profile="h100-hgx", **options)


def _local_numel(plan, fqn, shape) -> int:
    layout = parse_layout(plan.parameters[fqn])
    return math.prod(shape) // math.prod(plan.mesh.shape[a] for a, p in enumerate(layout) if p != autotp.Replicate())


def _data_parallel(op, strategy) -> bool:
    """Pure data parallelism (the batch of 4 split everywhere), with or without the optimizer state split."""
    return batch_split_only(4)(op, replace(strategy, optimizer_axes=()))


def test_optimizer_state_is_split_only_when_memory_binds_and_the_plan_says_so():
    mesh = autotp.Mesh("4", links="nvlink")
    assert _gpt_plan(mesh).optimizer_sharding == {}  # an all-gather per step for memory nobody asked to save
    free = _gpt_plan(mesh, allow=_data_parallel)
    assert free.optimizer_sharding == {}
    # data parallel under a limit: splitting the optimizer state is the only lever left
    tight = _gpt_plan(mesh, allow=_data_parallel, memory_limit=int(free.memory["total"] * 0.8), recompute=False,
                      micro_batches=1)
    assert tight.optimizer_sharding, tight.optimizer_sharding
    assert tight.memory["total"] <= free.memory["total"] * 0.8
    assert tight.predicted["total_s"] >= free.predicted["total_s"]  # the all-gathers after the step
    model, _ = make_model("gpt")
    expected = 0
    for fqn, p in model.named_parameters():
        numel = _local_numel(tight, fqn, p.shape)
        split = math.prod(tight.mesh.shape[tight.mesh.names.index(a)] for a in tight.optimizer_sharding.get(fqn, ()))
        expected += 8 * -(-numel // split)  # Adam's two fp32 moments, this device's slice
    assert tight.memory["optimizer"] == expected
    gathers = [c for c in tight.collectives if c["phase"] == "step"]  # one all-gather per split parameter
    shapes = dict((fqn, p.shape) for fqn, p in model.named_parameters())
    assert sorted((c["kind"], c["bytes"]) for c in gathers) == sorted(
        ("all_gather", 4 * _local_numel(tight, fqn, shapes[fqn])) for fqn in tight.optimizer_sharding)
    p = tight.predicted
    assert p["objective_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert "optimizer split on" in tight.summary()
    assert autotp.Plan.from_dict(tight.to_dict()).optimizer_sharding == tight.optimizer_sharding


def test_precision_sets_the_bytes_of_a_parameters_state():
    model, inputs = make_model("gpt")
    numel = sum(p.numel() for p in model.parameters())
    mesh = autotp.Mesh("2", links="nvlink")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    cases = {("auto", model): (4, 4, 8), ("auto", bf16): (2, 4, 12), ("mixed", bf16): (2, 4, 12),
             ("bf16", bf16): (2, 2, 4), ("fp32", model): (4, 4, 8)}
    for (precision, m), (weight, grad, state) in cases.items():
        plan = autotp.plan(m, mesh, inputs, profile="h100-hgx", allow=replicated_only, precision=precision)
        assert (plan.memory["parameters"], plan.memory["gradients"], plan.memory["optimizer"]) == (
            weight * numel, grad * numel, state * numel), precision
    with pytest.raises(PlanError, match="unknown training precision 'fp8'.*auto, fp32, mixed, bf16"):
        autotp.plan(model, mesh, inputs, profile="h100-hgx", precision="fp8")


def test_zero2_splits_the_gradient_too_and_costs_no_more_than_zero1():
    """Data parallel on 4, every optimizer state split: ZeRO-2 reduce-scatters each gradient into its slice."""
    mesh = autotp.Mesh("4", links="nvlink")
    model, inputs = make_model("gpt")
    plans = {stage: _gpt_plan(mesh, recompute=False, micro_batches=1, allow=lambda op, s, g=gradients: (
                 _data_parallel(op, s) and split_optimizer_where_whole(mesh.shape, g)(op, s)))
             for stage, gradients in (("zero1", False), ("zero2", True))}
    zero1, zero2 = plans["zero1"], plans["zero2"]
    assert zero1.gradient_sharding == [] and zero1.optimizer_sharding == zero2.optimizer_sharding
    # every parameter has one use here, so every gradient is split
    assert set(zero2.gradient_sharding) == set(zero2.parameters), zero2.gradient_sharding
    shapes = dict((fqn, p.shape) for fqn, p in model.named_parameters())
    whole = {fqn: _local_numel(zero2, fqn, shape) for fqn, shape in shapes.items()}
    assert zero2.memory["gradients"] == sum(4 * (-(-n // 4) if fqn in zero2.gradient_sharding else n)
                                            for fqn, n in whole.items())
    assert zero2.memory["total"] < zero1.memory["total"]
    assert zero2.predicted["total_s"] <= zero1.predicted["total_s"]  # a reduce-scatter instead of an all-reduce
    slices = {c["producer"]: c for c in zero2.collectives if c.get("slice")}
    assert len(slices) == len(zero2.gradient_sharding)
    assert all(c["kind"] == "reduce_scatter" and c["axis"] == "axis0" and c["bucketed"] for c in slices.values())
    assert not any(c["kind"] == "all_reduce" and c.get("bucketed") for c in zero2.collectives)
    p = zero2.predicted
    assert p["compute_s"] + p["comm_s"] - p["hidden_s"] == pytest.approx(p["total_s"], rel=1e-9)
    assert "+grad" in zero2.summary()
    assert autotp.Plan.from_dict(zero2.to_dict()).gradient_sharding == zero2.gradient_sharding


def _zero_plans(mesh):
    model, inputs = make_model("gpt")
    plans = {}
    for stage, gradients in (("zero1", False), ("zero2", True)):
        split = split_optimizer_where_whole(mesh.shape, gradients)
        plans[f"{stage} data_parallel"] = autotp.plan(model, mesh, inputs, profile=compute_bound_profile(),
                                                      allow=lambda op, s, f=split: _data_parallel(op, s) and f(op, s))
        plans[f"{stage} tensor_parallel"] = autotp.plan(model, mesh, inputs, profile=compute_bound_profile(),
                                                        allow=split, pin=megatron_pins("gpt", model, mesh))
    # the gradient summed over both axes, split over dp alone: all-reduced on tp, then reduce-scattered on dp
    plans["zero2 on dp of a sum over both"] = autotp.plan(
        model, mesh, inputs, profile=compute_bound_profile(),
        allow=lambda op, s: _data_parallel(op, s) and (op.kind != KIND_PARAM or not op.requires_grad or (
            s.optimizer_axes == (0,) and s.gradient_split)))
    return plans


def _batch(step: int, inputs) -> tuple:
    torch.manual_seed(100 + step)  # a new batch each step, the same on every rank
    return torch.randint(0, 64, inputs[0].shape), torch.randint(0, 64, inputs[1].shape)


def _resumed(plan, directory, made, inputs) -> torch.nn.Module:
    """A new rank module and split optimizer loaded from the checkpoint, after one more step (``made``: its model
    and capture, `made_for_ranks`)."""
    model, captured = made
    local = autotp.parallelize(model, plan, captured=captured)
    optimizer = shard_optimizer(local, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    load_sharded(directory, local, optimizer, plan, torch.distributed.get_rank())
    local(*_batch(STEPS, inputs)).backward()
    optimizer.step()
    return local


def _made(plans, world) -> dict:
    """Per plan, the three models its ranks lower (split optimizer, plain, resumed), with their captures."""
    return {name: [made_for_ranks(lambda: make_model("gpt")[0], plan, world) for _ in range(3)]
            for name, plan in plans.items()}


def _train(rank, world, plans, directory, made):
    """Per plan: the single device, the rank module with its optimizer state split, and with a plain optimizer."""
    out = {}
    for name, plan in plans.items():
        inputs = make_model("gpt")[1]
        (model, captured), (other, captured_other), again = made[name]
        reference = copy.deepcopy(model)
        split = autotp.parallelize(other, plan, captured=captured_other)
        plain = autotp.parallelize(model, plan, captured=captured)
        optimizers = [torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1),
                      shard_optimizer(split, torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                      torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)]
        losses = []
        resumed = None
        sliced = []  # ZeRO-2: (parameter numel, its gradient slice's numel) after a backward pass, .grad empty
        for step in range(STEPS + 1):
            if step == STEPS:  # saved after the last step, resumed in a new module, both one step further
                save_sharded(f"{directory}/{name}", split, optimizers[1], plan, rank, step)
                resumed = _resumed(plan, f"{directory}/{name}", again, inputs)
            batch = _batch(step, inputs)
            step_losses = [module(*batch) for module in (reference, split, plain)]
            for loss, optimizer in zip(step_losses, optimizers):
                loss.backward()
                if step == 0 and optimizer is optimizers[1]:
                    sliced = [(p.numel(), p.autotp_gradient_slice.numel()) for p in split.parameters()
                              if getattr(p, "autotp_gradient_slice", None) is not None and p.grad is None]
                optimizer.step()
                optimizer.zero_grad()
            losses.append(tuple(loss.item() for loss in step_losses))
        # the all-gathers after the last step are left for the next forward pass to wait for: land them to read
        pending = sum(getattr(p, "autotp_pending", None) is not None for p in split.parameters())
        wait_parameters(split)
        wait_parameters(resumed)
        # Adam turns rounding noise in a gradient that is zero in exact arithmetic (a key bias: softmax ignores
        # it) into steps of the learning rate, so the parameters are compared with the same rank program's
        # under a plain optimizer: what splitting the optimizer state alone changes
        theirs, again = dict(plain.named_parameters()), dict(resumed.named_parameters())
        params = max(scaled_error(p, theirs[n]) for n, p in split.named_parameters())
        resume = max(scaled_error(p, again[n]) for n, p in split.named_parameters())
        out[name] = {"losses": losses, "parameters": params, "resume": resume, "sliced": sliced, "pending": pending,
                     "split": len(split.autotp_optimizer_shards),
                     "state": sum(s.numel() for group in optimizers[1].param_groups for s in group["params"])}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    mesh = autotp.Mesh("2x2", names=("dp", "tp"))  # the roles the plans below give the axes
    plans = _zero_plans(mesh)
    return plans, spawn(_train, mesh.size, plans, str(tmp_path_factory.mktemp("zero")), _made(plans, mesh.size))


def test_three_adamw_steps_with_split_optimizer_state_match_one_device(trained):
    plans, per_rank = trained
    mixed = plans["zero2 on dp of a sum over both"]
    assert set(map(tuple, mixed.optimizer_sharding.values())) == {("dp",)} and mixed.gradient_sharding
    assert {c["axis"] for c in mixed.collectives if c.get("bucketed")} == {"tp", "dp"}
    for stage in ("zero1", "zero2"):
        dp, tp = plans[f"{stage} data_parallel"], plans[f"{stage} tensor_parallel"]
        assert set(map(tuple, dp.optimizer_sharding.values())) == {("dp", "tp")}  # the whole mesh: one group of 4
        # Megatron's split weights on tp have their state split on dp alone; the norms' on the whole mesh
        assert set(map(tuple, tp.optimizer_sharding.values())) == {("dp",), ("dp", "tp")}
        assert any(any(p != "R" for p in layout) for layout in tp.parameters.values())
        assert bool(dp.gradient_sharding) == bool(tp.gradient_sharding) == (stage == "zero2")
    for rank, by_plan in enumerate(per_rank):
        for name, result in by_plan.items():
            where = f"{name}, rank {rank}"
            for step, (want, got, plain) in enumerate(result["losses"]):
                assert abs(want - got) <= TOLERANCE * max(1.0, abs(want)), f"{where}: step {step} loss {got} != {want}"
                assert got == plain, f"{where}: step {step}"
            assert result["parameters"] <= 1e-7, f"{where}: parameter error {result['parameters']:.2e}"
            assert result["resume"] == 0.0, f"{where}: resumed from a checkpoint, error {result['resume']:.2e}"
            assert result["split"] == len(plans[name].optimizer_sharding) > 0, where
            assert result["pending"] == result["split"], where  # every all-gather ran behind the next forward pass
            # ZeRO-2 leaves each device a quarter (or half, split on dp alone) of the gradient, and no .grad
            split = len(plans[name].gradient_sharding)
            assert len(result["sliced"]) == split, where
            assert all(got < numel for numel, got in result["sliced"]), where
    # each rank's optimizer holds a quarter of the data-parallel model's state (padded slices)
    numel = sum(p.numel() for p in make_model("gpt")[0].parameters())
    assert per_rank[0]["zero2 data_parallel"]["state"] <= numel / 4 + 4 * len(dp.parameters)


def test_master_weights_keep_the_update_in_fp32_for_bf16_parameters():
    """``master_dtype``: a bf16 parameter is the fp32 master's cast after every step, whatever the rounding."""
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4).to(torch.bfloat16)
    reference = copy.deepcopy(module).float()  # the same starting values, in fp32
    optimizers = [torch.optim.AdamW(reference.parameters(), lr=1e-3),
                  shard_optimizer(module, torch.optim.AdamW, lr=1e-3, master_dtype=torch.float32)]
    for step in range(3):
        for ref, p in zip(reference.parameters(), module.parameters()):
            grad = torch.randint(-4, 5, p.shape).to(torch.bfloat16)  # exact in both dtypes
            ref.grad, p.grad = grad.float(), grad
        for optimizer in optimizers:
            optimizer.step()
        for ref, p in zip(reference.parameters(), module.parameters()):
            assert p.grad is None  # freed: the master slice took it
            assert torch.equal(p, ref.detach().to(torch.bfloat16)), step
    masters = [t for group in optimizers[1].param_groups for t in group["params"]]
    assert all(t.dtype == torch.float32 for t in masters)
    assert torch.equal(torch.cat([t.detach() for t in masters]),
                       torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
