"""Random ops on split tensors draw the single device's values (issue 16).

A small model whose hidden features are split over 2 gloo ranks (Megatron's
column-parallel ``fc1``, row-parallel ``fc2``, pinned) draws random numbers
four ways on the split hidden tensor: ``dropout``, ``feature_dropout``
(``Dropout1d`` on ``[batch, features, length]``), ``rand_like`` and
``randn_like``; its input ``x`` is also dropped while replicated. From the same
seed as the single device, on every rank: the output and every gradient
match the single device's to 1e-6, two steps in a row (the second draws where
the first left the generator), the generator ends where the single device's
does, and the random ops really are split (each runs as a whole draw) and
really drew (the two steps differ). The cost model charges the whole draw.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.api import capture_model
from autotp.cost.compute import forward_time_s
from autotp.cost.profile import load_profile
from autotp.placement import R, Shard
from autotp.runtime import spawn
from autotp.runtime.verify import scaled_error, worst_gradient_error
from autotp.strategies.base import Strategy
from conftest import compute_bound_profile

TOLERANCE = 1e-6
RANDOM = ("dropout", "feature_dropout", "rand_like", "randn_like")


class Noisy(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 8)

    def forward(self, x):
        x = F.dropout(x, 0.25, self.training)  # replicated: every rank draws the same mask
        h = torch.relu(self.fc1(x))  # [batch, length, hidden]: hidden split
        h = F.dropout(h, 0.5, self.training)
        h = F.dropout1d(h.transpose(1, 2), 0.3, self.training).transpose(1, 2)  # whole channels dropped
        h = h + 0.1 * torch.rand_like(h) - 0.1 * torch.randn_like(h)
        return self.fc2(h).sum()


def _model():
    torch.manual_seed(0)
    return Noisy(), (torch.randn(4, 6, 8),)


def _plan(mesh):
    model, inputs = _model()
    pins = {"fc1.weight": ("S(0)",), "fc1.bias": ("S(0)",), "fc2.weight": ("S(1)",), "fc2.bias": ("R",)}
    return autotp.plan(model, mesh, inputs, pin=pins, profile=compute_bound_profile())


def _run(rank, world, plan):
    model, inputs = _model()
    reference = _model()[0]
    local = autotp.parallelize(model, plan)
    out = {"whole_draws": sum(1 for name, _ in local.named_modules() if name.startswith("whole_draw_"))}
    errors = []
    for step in range(2):
        torch.manual_seed(100 + step) if step == 0 else None  # the second step draws where the first left off
        start = torch.get_rng_state()
        want = reference(*inputs)
        want.backward()
        ends = torch.get_rng_state()
        torch.set_rng_state(start)
        got = local(*inputs)
        got.backward()
        errors.append(scaled_error(got, want))
        out.setdefault("generator_alike", []).append(torch.equal(torch.get_rng_state(), ends))
        out.setdefault("losses", []).append(float(got.detach()))
    out["output"], out["gradient"] = max(errors), worst_gradient_error(local, reference, plan, rank)
    return out


@pytest.fixture(scope="module")
def results():
    plan = _plan(autotp.Mesh("2"))
    return plan, spawn(_run, 2, plan)


def test_split_random_ops_draw_the_single_devices_values(results):
    plan, per_rank = results
    split = {e.op.split(".")[0] for e in plan.nodes.values()
             if e.op.split(".")[0] in RANDOM and any(isinstance(p, Shard) for p in e.out_layout())}
    assert split == set(RANDOM), f"random ops split: {split}: the check would prove less"
    for rank, e in enumerate(per_rank):
        assert e["whole_draws"] >= len(RANDOM), (rank, e["whole_draws"])
        assert e["output"] <= TOLERANCE and e["gradient"] <= TOLERANCE, (rank, e["output"], e["gradient"])
        assert all(e["generator_alike"]), f"rank {rank}: the generator did not advance as on one device"
        assert e["losses"][0] != e["losses"][1], "the two steps drew the same: the masks prove nothing"
    assert per_rank[0]["losses"] == per_rank[1]["losses"]


class _Drop(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, True)


def _dropout_time(p: float, layout) -> float:
    x = torch.empty(4096, 16384, device="meta")
    graph = capture_model(_Drop(p), (x,)).graph
    op = next(o for o in graph.nodes() if o.op_name == "dropout.default")
    return forward_time_s(op, Strategy(out=layout, ins=(layout,)), autotp.Mesh("8"), load_profile("h100-hgx"))


def test_a_split_draw_costs_the_whole_tensor():
    """Split 8 ways, a dropout that draws costs more than whole (its piece plus the whole draw); one that draws
    nothing (p = 0) costs its piece."""
    split, whole = (Shard(1),), (R,)
    assert _dropout_time(0.5, split) > _dropout_time(0.5, whole)
    assert _dropout_time(0.0, split) < _dropout_time(0.0, whole) / 4
