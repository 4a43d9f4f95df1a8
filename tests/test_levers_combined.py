"""ZeRO-1, 2 and 3, recomputation and micro-batches, each alone and all in one plan, exact on 2x2 gloo (issue 15).

The model is `helpers.dropout_net` (two residual MLP blocks with dropout, an
embedding, a head and a loss; a step's batch of 16 x 8 tokens). Every plan
keeps the layouts of every op of the plan with no lever (the ILP's under
Megatron's pins on ``tp``, the batch split on ``dp``) and forces its levers
on top: the parameters' placements and optimizer splits by pins and a filter
on their strategies, micro-batches by ``autotp.plan(micro_batches=4)``,
recomputation and regathering by naming them in the plan (the lowering runs
what the plan names, as in test_recompute.py and test_regather.py). The
plans' own fields show each lever, and only it, really in use:

1. ZeRO-1: every trained parameter's optimizer state split over the axes
   where it is whole (``plan.optimizer_sharding``), gradients whole;
2. ZeRO-2: the gradients split with it (``plan.gradient_sharding``: the
   reducer reduce-scatters each into this device's slice, no ``.grad``);
3. ZeRO-3: every matrix (embedding, projections, head) stored split on
   ``dp`` too (``plan.parameters``), all-gathered at its use and gathered
   again in backward (``plan.regather == ["weights"]``);
4. both blocks recomputed in backward (``plan.recompute``);
5. the step run as 4 micro-batches (``plan.micro_batches``, by
   `autotp.runtime.accumulate`);
6. all of them at once: 4 micro-batches, both blocks recomputed, the
   matrices stored split on ``dp`` and regathered, every other parameter's
   optimizer state and gradient split (the embedding's state on ``tp``).

The ZeRO-3 plan also compiles whole (``torch.compile(fullgraph=True)``, Dynamo
and AOTAutograd through the ``aot_eager`` backend) and stays exact.

On every rank of 4 real gloo processes, with dropout off, under each plan and
under the plan with no lever: the step's loss and every gradient (under
ZeRO-2, this device's slice of it) match the single device's to 1e-5, the
regathering plans run more all-gathers on ``dp`` in the step than their
forward passes do, and three AdamW steps (weight decay 0.1; the optimizer
from `autotp.runtime.shard_optimizer`) give the single device's losses to
1e-5. With dropout on (p = 0.3), from the same seeds, the losses of three
AdamW steps match too, while they differ from dropout off's by over 100
times that: each split dropout draws the single device's mask
(`autotp.lower.random_ops`) and no lever changes one. The plan with no lever
and levers 1 to 4 are compared with the single device; k micro-batches draw
k masks where one device draws one for the whole batch, so all the levers
together are compared with micro-batches alone.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.graph.opgraph import KIND_PARAM
from autotp.lower import shard_tensor
from autotp.lower.collectives import CommCounter
from autotp.placement import parse_layout
from autotp.runtime import accumulate, shard_optimizer
from autotp.runtime.verify import scaled_error
from autotp.solve.constraints import same_as
from conftest import compute_bound_profile
from helpers import (dropout_net, made_for_ranks, megatron_pins, planned_and_run, recomputed_stretches,
                     split_optimizer_where_whole)

TOLERANCE = 1e-5
STEPS = 3
BATCH = 16
DROPOUT = 0.3
ADAMW = dict(lr=1e-2, weight_decay=0.1)
LAYERS = ["blocks.0", "blocks.1"]
MATRICES = ["tok.weight", "blocks.0.up.weight", "blocks.0.down.weight", "blocks.1.up.weight",
            "blocks.1.down.weight", "head.weight"]
# with dropout on, the plans with micro-batches (k masks, not one) are compared with micro-batches alone
WITHOUT_LEVER = {"all": "micro_batches"}


def _make(p: float):
    return dropout_net(p, seq=8, batch=BATCH)


def _plans(mesh) -> dict:
    model, inputs = _make(0.0)
    options = dict(profile=compute_bound_profile(), memory_limit=None, recompute=False, regather=False)
    pins = megatron_pins("dropout_net", model, mesh)
    none = autotp.plan(model, mesh, inputs, pin=pins, micro_batches=1, optimizer_sharding=False, **options)
    # ZeRO-3: each matrix split on dp as well, on the dim that tp leaves whole
    stored_split = {fqn: ("S(1)" if tp == "S(0)" else "S(0)", tp) if fqn in MATRICES else (dp, tp)
                    for fqn, (dp, tp) in pins.items()}
    state_whole = lambda op, s: not s.optimizer_axes  # noqa: E731
    zero1, zero2 = (split_optimizer_where_whole(mesh.shape, gradients) for gradients in (False, True))

    def lever(pin, parameters, micro_batches=1, **fields):
        """The plan with no lever's layouts for every op, ``pin`` and the filter ``parameters`` for the parameters,
        and ``fields`` set on the plan."""
        layouts = same_as(none)

        def allow(op, strategy) -> bool:
            return parameters(op, strategy) if op.kind == KIND_PARAM else layouts(op, strategy)

        allow.strict = True
        plan = autotp.plan(model, mesh, inputs, pin=pin, allow=allow, micro_batches=micro_batches, **options)
        return autotp.Plan.from_dict({**plan.to_dict(), **fields})

    return {"none": none, "zero1": lever(pins, zero1), "zero2": lever(pins, zero2),
            "zero3": lever(stored_split, state_whole, regather=["weights"]),
            "recompute": lever(pins, state_whole, recompute=LAYERS),
            "micro_batches": lever(pins, state_whole, 4),
            "all": lever(stored_split, zero2, 4, regather=["weights"], recompute=LAYERS)}


def _levers(plan) -> set[str]:
    """The levers a plan's fields show."""
    shown = {"optimizer state split": plan.optimizer_sharding, "gradients split": plan.gradient_sharding,
             "weights stored split on dp": any(plan.parameters[fqn][0] != "R" for fqn in plan.parameters),
             "regathered": plan.regather, "recomputed": plan.recompute, "micro-batches": plan.micro_batches > 1}
    return {name for name, on in shown.items() if on}


def _gathered_on_dp(plan) -> set[str]:
    """The producers of the plan's forward all-gathers on dp (one call each per micro-batch)."""
    return {c["producer"] for c in plan.collectives if (c["kind"], c["axis"], c["phase"]) == ("all_gather", "dp",
                                                                                             "forward")}


def _batches(inputs) -> list:
    """The example batch, then a new one for each step, the same on every rank."""
    out = [inputs]
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        out.append((torch.randint(0, 32, (BATCH, 8)), torch.randint(0, 32, (BATCH, 8))))
    return out


def _gradient_error(local, reference, plan, rank) -> tuple[float, int]:
    """The largest `scaled_error` of this rank's gradients against its pieces of the single device's, and how many
    were ZeRO-2 slices (no ``.grad``: this device's 1/n of the flattened gradient, compared as such)."""
    coords, ref = plan.mesh.coords(rank), dict(reference.named_parameters())
    comms = {id(p): comm for p, comm in getattr(local, "autotp_optimizer_shards", [])}
    worst, sliced = 0.0, 0
    for name, p in local.named_parameters():
        want, got = shard_tensor(ref[name].grad, parse_layout(plan.parameters[name]), plan.mesh.shape, coords), p.grad
        if got is None:
            comm, sliced = comms[id(p)], sliced + 1
            size = -(-want.numel() // comm.size)
            want = want.reshape(-1)[comm.index * size:(comm.index + 1) * size]
            got = p.autotp_gradient_slice[:want.numel()]
        worst = max(worst, scaled_error(got, want))
    return worst, sliced


def _train(step, optimizer, batches, seed: int | None = None, first=None) -> list[float]:
    """The loss of each batch, an optimizer step between two (``step(*batch)`` runs forward and backward; ``first``:
    the first batch's loss, when its forward and backward already ran)."""
    losses = []
    for i, batch in enumerate(batches):
        if i:
            optimizer.step()
            optimizer.zero_grad()
        if seed is not None:
            torch.manual_seed(seed + i)
        losses.append(float(step(*batch) if i or first is None else first))
    return losses


def _single_device(module):
    def step(*batch):
        loss = module(*batch)
        loss.backward()
        return loss.detach()
    return step


def _ready(plans, world):
    """Per plan, the models its ranks lower, with their captures (`made_for_ranks`): without dropout, with it,
    and for ZeRO-3 a third one compiled whole."""
    dropout = {"plain": 0.0, "noisy": DROPOUT, "whole": 0.0}
    return {name: {kind: made_for_ranks(lambda p=p: _make(p)[0], plan, world)
                   for kind, p in dropout.items() if kind != "whole" or name == "zero3"}
            for name, plan in plans.items()}


def _run(rank, world, plans, ready):
    inputs = _make(0.0)[1]
    batches = _batches(inputs)
    first = _make(0.0)[0]
    want = _single_device(first)(*inputs)  # the single device's loss and gradients of the first step
    reference = _make(0.0)[0]
    want_losses = _train(_single_device(reference), torch.optim.AdamW(reference.parameters(), **ADAMW),
                         batches)
    noisy = _make(DROPOUT)[0]
    want_dropped = _train(_single_device(noisy), torch.optim.AdamW(noisy.parameters(), **ADAMW), batches, seed=7)
    out = {}
    for name, plan in plans.items():
        counter = CommCounter()
        model, captured = ready[name]["plain"]
        local = autotp.parallelize(model, plan, counter=counter, captured=captured)
        optimizer = shard_optimizer(local, torch.optim.AdamW, **ADAMW)
        got = accumulate(local, plan, *inputs)
        gradient, sliced = _gradient_error(local, first, plan, rank)
        gathers = sum(1 for kind, axis, _ in counter.calls if kind == "all_gather" and axis == "dp")
        losses = _train(lambda *b: accumulate(local, plan, *b), optimizer, batches, first=got)
        # with dropout on, from the same seeds as the single device's
        model, captured = ready[name]["noisy"]
        noisy = autotp.parallelize(model, plan, captured=captured)
        dropped = _train(lambda *b: accumulate(noisy, plan, *b),
                         shard_optimizer(noisy, torch.optim.AdamW, **ADAMW), batches, seed=7)
        if name == "zero3":  # compiled whole: regathering's hooks step aside while Dynamo traces
            model, captured = ready[name]["whole"]
            whole = autotp.parallelize(model, plan, captured=captured)
            loss = torch.compile(whole, fullgraph=True, backend="aot_eager")(*inputs)
            loss.backward()
            compiled = (scaled_error(loss, want), _gradient_error(whole, first, plan, rank)[0])
        out[name] = {"output": scaled_error(got, want), "gradient": gradient, "sliced": sliced,
                     "compiled": compiled if name == "zero3" else None,
                     "want": want_losses, "losses": losses, "dropped": dropped, "want_dropped": want_dropped,
                     "dp_gathers": gathers,
                     "split": len(getattr(local, "autotp_optimizer_shards", [])),
                     "stretches": recomputed_stretches(local)}
    return out


@pytest.fixture(scope="module")
def results():
    mesh = autotp.Mesh("2x2", names=("dp", "tp"))  # the roles the plans give them
    return planned_and_run(_run, _plans, mesh, _ready)


def test_each_plan_really_uses_its_levers(results):
    plans, _ = results
    none = plans["none"]
    assert none.nodes["dropout"].out[0] == "S(0)", "the batch is not split on dp: no data parallelism to test"
    assert none.parameters["blocks.0.up.weight"] == ("R", "S(0)")  # Megatron's column-parallel split on tp
    zero3 = {"weights stored split on dp", "regathered"}
    assert {name: _levers(plan) for name, plan in plans.items()} == {
        "none": set(), "zero1": {"optimizer state split"}, "zero2": {"optimizer state split", "gradients split"},
        "zero3": zero3, "recompute": {"recomputed"}, "micro_batches": {"micro-batches"},
        "all": {"optimizer state split", "gradients split", "recomputed", "micro-batches"} | zero3}
    every = set(none.parameters)
    assert set(plans["zero1"].optimizer_sharding) == set(plans["zero2"].gradient_sharding) == every
    for name in ("zero3", "all"):
        plan = plans[name]
        assert all(plan.parameters[fqn][0] != "R" for fqn in MATRICES), name
        assert _gathered_on_dp(plan) == {fqn.replace(".", "_") for fqn in MATRICES}, name  # each at its use
    combined = plans["all"]
    # ZeRO-2 only where the weight is whole on dp (the matrices are split there instead), and where the ILP finds a
    # reduce-scatter after each of the 4 micro-batches worth it over one all-reduce after the last
    assert combined.gradient_sharding and set(combined.gradient_sharding) <= every - set(MATRICES)
    assert combined.optimizer_sharding["tok.weight"] == ["tp"]
    assert combined.recompute == LAYERS and combined.micro_batches == 4
    assert combined.inputs["args"][0]["shape"] == [BATCH // 4, 8]


def test_each_lever_alone_and_all_together_train_exactly_as_one_device(results):
    plans, per_rank = results
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            plan, where = plans[name], f"{name}, rank {rank}"
            assert e["output"] <= TOLERANCE, f"{where}: loss error {e['output']:.2e}"
            assert e["gradient"] <= TOLERANCE, f"{where}: gradient error {e['gradient']:.2e}"
            assert len(e["losses"]) == len(e["want"]) == STEPS + 1, where
            for step, (want, got) in enumerate(zip(e["want"], e["losses"])):
                assert abs(want - got) <= TOLERANCE * max(1.0, abs(want)), f"{where}: step {step}: {got} != {want}"
            # the levers ran: slices of the optimizer state and of the gradients, checkpointed blocks
            assert e["split"] == len(plan.optimizer_sharding), where
            assert e["sliced"] == len(plan.gradient_sharding), where
            assert (e["stretches"] >= len(LAYERS)) == bool(plan.recompute), (where, e["stretches"])
            # regathered: backward gathers again, so the step runs more all-gathers on dp than its forward passes
            forward = plan.micro_batches * len(_gathered_on_dp(plan))
            assert (e["dp_gathers"] > forward) == bool(plan.regather), (where, e["dp_gathers"], forward)


def test_the_regathering_plan_compiles_whole_and_stays_exact(results):
    """``torch.compile(fullgraph=True)`` of the ZeRO-3 rank module: one graph (any break is an error), loss and
    every gradient within 1e-5 of the single device (`autotp.lower.regather`: regathering steps aside while compiled)."""
    plans, per_rank = results
    assert plans["zero3"].regather == ["weights"]
    for rank, by_plan in enumerate(per_rank):
        output, gradient = by_plan["zero3"]["compiled"]
        assert output <= TOLERANCE and gradient <= TOLERANCE, (rank, output, gradient)


def test_with_dropout_on_each_plan_trains_as_one_device(results):
    plans, per_rank = results
    for rank, by_plan in enumerate(per_rank):
        for name, e in by_plan.items():
            where = f"{name}, rank {rank}"
            drew = max(abs(a - b) for a, b in zip(e["dropped"], e["losses"]))
            assert drew > 100 * TOLERANCE, f"{where}: dropout moved the losses by {drew:.1e}: the check proves nothing"
            if name in WITHOUT_LEVER:
                want_losses, against = by_plan[WITHOUT_LEVER[name]]["dropped"], WITHOUT_LEVER[name]
            elif plans[name].micro_batches == 1:
                want_losses, against = e["want_dropped"], "one device"
            else:
                continue  # micro-batches alone: what the plans with micro-batches are compared with
            for step, (want, got) in enumerate(zip(want_losses, e["dropped"])):
                assert abs(want - got) <= TOLERANCE * max(1.0, abs(want)), \
                    f"{where}: step {step} with dropout: {got} != {want} ({against})"
