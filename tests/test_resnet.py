"""ResNet-18 (examples/resnet.py) on 2 gloo processes: outputs, every gradient and the BatchNorm buffers exact.

The plan is data parallel: every convolution and batch norm sees half the
batch, so each batch norm's statistics are partial sums, all-reduced before
use (synchronised batch norm). The running statistics of every rank must then
equal the single-device model's, as must the outputs and every gradient.
Channel-split convolutions and batch norms (what the ILP picks under the
compute-bound profile) run end to end in tests/test_odd_cases.py, whose
models are small enough to run more plans; ``python examples/resnet.py``
replays the ILP's plan of the full-size model.
"""

from __future__ import annotations

import autotp
from autotp.runtime import spawn
from autotp.placement import R
from autotp.solve.constraints import data_parallel_only
from conftest import compute_bound_profile
from resnet import check_rank, small

TOLERANCE = 1e-9  # float64: see resnet.small


def float64_profile() -> dict:
    """The compute-bound test profile, with float64 as fast as float32 (the model runs in float64)."""
    profile = compute_bound_profile()
    profile["device"]["peak_flops"]["float64"] = profile["device"]["peak_flops"]["float32"]
    return profile


def sync_batch_norm(op, strategy) -> bool:
    """Data parallel, and every sum (a batch norm's statistics) taken over the split batch: a partial sum.

    Under the compute-bound profile gathering the activations costs about
    what all-reducing the statistics does, so without this the ILP may gather
    some batch norms' inputs; this forces the synchronised form everywhere.
    """
    return data_parallel_only(op, strategy) and not (op.op_name == "sum.dim_IntList" and strategy.ins[0] == (R,))


def test_resnet18_data_parallel_is_exact_with_batch_norm_buffers_in_sync():
    mesh = autotp.Mesh("2")
    model, inputs = small()
    plan = autotp.plan(model, mesh, inputs, profile=float64_profile(), allow=sync_batch_norm)
    assert not plan.fallback_ops, plan.fallback_ops
    convs = [n for n in plan.nodes.values() if n.op == "conv2d.default"]
    assert len(convs) == 20 and all(n.out == ("S(0)",) for n in convs)  # ResNet-18's 20 convolutions, batch split
    forward = [c for c in plan.collectives if c["phase"] == "forward"]
    stats = [c for c in forward if c["kind"] == "all_reduce" and c["bytes"] <= 64 * 8]
    assert len(stats) >= 2 * 20, "each of the 20 batch norms all-reduces its mean and its variance"
    # no activation is gathered (the logits come back split by batch, as with DDP); the compute-bound profile
    # may split the running statistics' updates over channels and gather those small vectors into the buffers
    assert all(c["bytes"] <= 64 * 8 for c in forward if c["kind"] == "all_gather"), "an activation is gathered"
    assert plan.io["outputs"] == [("S(0)",)] and plan.io["inputs"] == [["x", ("S(0)",)]]
    for rank, errors in enumerate(spawn(check_rank, mesh.size, plan)):
        where = f"rank {rank}"
        assert errors["output"] <= TOLERANCE, f"{where}: output error {errors['output']:.2e}"
        assert errors["gradient"] <= TOLERANCE, f"{where}: gradient error {errors['gradient']:.2e}"
        assert errors["buffers"] <= TOLERANCE, f"{where}: buffer error {errors['buffers']:.2e}"
        assert errors["parameters"] == 62, where

