"""Golden plans: on known models the ILP must find the known-good plan, at the predicted cost.

Under the H100 profile on mesh 4, every collective run whole (``overlap_tp=False``: with collective
matmuls the same splits take sequence parallelism's reduce-scatter and all-gather, which the matmuls hide,
instead of all-reduces: tests/test_plan_quality.py, tests/test_collective_matmul.py):
- a large MLP whose output is wanted whole on every rank gets Megatron's
  column-then-row split with one forward all-reduce, and the ILP objective
  equals the closed form computed here from the profile;
- a GPT in the small-batch regime (weights much larger than activations) gets
  column q/k/v/up, row proj/down: two all-reduces per block in forward.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.cost.profile import PROFILE_DIR
from autotp.lower import lower
from models import GPT, MLP

HIDDEN, FFN, TOKENS = 4096, 16384, 8 * 512


@pytest.fixture(scope="module")
def mlp_plan():
    with torch.device("meta"):
        model = MLP(HIDDEN, FFN)
    x = torch.empty(8, 512, HIDDEN, device="meta")
    return model, x, autotp.plan(model, autotp.Mesh("4"), (x,), training=True, whole_outputs=True, overlap_tp=False)


def test_mlp_is_column_then_row(mlp_plan):
    _, _, plan = mlp_plan
    assert plan.parameters["fc1.weight"] == ("S(0)",)
    assert plan.parameters["fc2.weight"] == ("S(1)",)
    assert plan.parameters["fc1.bias"] == ("S(0)",)
    assert plan.parameters["fc2.bias"] == ("R",)
    assert [c["kind"] for c in plan.forward_collectives()] == ["all_reduce"]


def test_mlp_lowered_graph_has_one_all_reduce(mlp_plan):
    model, x, plan = mlp_plan
    local = lower(capture(model, (x,)), plan, rank=1)  # inspection only: no process group needed
    calls = [n.target for n in local.graph.nodes if n.op == "call_module"]
    # x enters the column-split fc1 replicated; no gradient flows back to it, so there is no f step either
    assert calls == ["all_reduce_axis0"], local.code
    assert dict(local.named_parameters())["fc1.weight"].shape == (FFN // 4, HIDDEN)
    assert dict(local.named_parameters())["fc2.weight"].shape == (HIDDEN, FFN // 4)


def _closed_form_s(profile: dict, n: int) -> float:
    """Step time of Megatron's MLP plan, by hand: roofline per op, times 3 for training, plus one all-reduce."""
    dev, f4 = profile["device"], 4  # fp32 bytes
    peak = dev["peak_flops"]["float32"] * dev["matmul_efficiency"]
    bw = dev["memory_bandwidth_Bps"] * dev["memory_efficiency"]
    launch, train = dev["launch_overhead_s"], 1 + dev["backward_compute_factor"]
    T, H, F = TOKENS, HIDDEN, FFN // n

    def op(flops, nbytes):
        return max(flops / peak, nbytes / bw) + launch

    ops = [
        op(2 * T * H * F, f4 * (T * H + F * H + T * F)),  # fc1: x R, weight S(0) -> (T, F) S(1)
        op(T * F, f4 * (T * F + F + T * F)),  # + bias S(0)
        op(T * F, f4 * (T * F + T * F)),  # gelu
        op(2 * T * F * H, f4 * (T * F + H * F + T * H)),  # fc2: row split -> P
        op(T * H, f4 * (T * H + H + T * H)),  # + bias, after the all-reduce
    ]
    message = f4 * T * H
    nvlink = profile["links"]["nvlink"]
    points = nvlink["busbw_Bps"]["all_reduce"]
    lo = max(p for p in points if p[0] <= message)
    hi = min(p for p in points if p[0] >= message)
    import math

    t = 0 if hi[0] == lo[0] else (math.log(message) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
    busbw = lo[1] + t * (hi[1] - lo[1])
    all_reduce = nvlink["latency_s"] + 2 * (n - 1) / n * message / busbw
    return train * sum(ops) + all_reduce


def test_mlp_objective_equals_closed_form(mlp_plan):
    _, _, plan = mlp_plan
    profile = json.loads((PROFILE_DIR / "h100-hgx.json").read_text())
    expected = _closed_form_s(profile, 4)
    assert plan.predicted["objective_s"] == pytest.approx(expected, rel=1e-6)
    assert plan.predicted["total_s"] == pytest.approx(expected, rel=1e-6)


def test_gpt_blocks_get_two_forward_all_reduces():
    layers = 2
    with torch.device("meta"):
        model = GPT(vocab=32000, hidden=8192, heads=64, layers=layers, seq=16)
    idx = torch.zeros(1, 16, dtype=torch.long, device="meta")
    plan = autotp.plan(model, autotp.Mesh("4"), (idx, idx), overlap_tp=False)
    for i in range(layers):
        for name in ("q", "k", "v", "up"):
            assert plan.parameters[f"blocks.{i}.{name}.weight"] == ("S(0)",), name
        for name in ("proj", "down"):
            assert plan.parameters[f"blocks.{i}.{name}.weight"] == ("S(1)",), name
    forward = Counter(c["kind"] for c in plan.forward_collectives())
    # two all-reduces per block; the vocabulary-split LM head's logits are gathered once for the loss
    assert forward == Counter({"all_reduce": 2 * layers, "all_gather": 1})
    gather, = [c for c in plan.forward_collectives() if c["kind"] == "all_gather"]
    assert plan.nodes[gather["producer"]].ins[1] == ("S(0)",) and gather["bytes"] == 16 * 32000 * 4
    assert not plan.fallback_ops.keys() - {"arange"}
