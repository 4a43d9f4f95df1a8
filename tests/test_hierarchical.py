"""Multi-axis sums: per-axis, hierarchical or flat chosen by cost, and exact when lowered on a 2x2 gloo mesh.

The choice is checked against costs computed here from the profile's own
formula (``latency + factor * bytes / busbw(collective, bytes)`` per axis),
not against hard-coded numbers.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.cost.profile import load_profile
from autotp.cost.reshard import cheapest_steps, edge_times_s
from autotp.graph.opgraph import KIND_PARAM, TensorMeta
from autotp.lower.rewrite import lower
from autotp.placement import P, R, Shard
from autotp.runtime.verify import max_errors
from helpers import planned_and_run
from conftest import COLLECTIVES, compute_bound_profile
from models import MLP

GIB = 2**30
MESH = autotp.Mesh((4, 8), names=("dp", "tp"), links=("ethernet", "nvlink"))
TOLERANCE = 1e-5


def _time(profile, link: str, kind: str, n: int, nbytes: float) -> float:
    """One collective on n devices, written out from docs/cost-model.md."""
    curve = profile.link(link)
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return curve.latency_s + factor * nbytes / curve.busbw(kind, nbytes)


def _per_axis_s(profile, nbytes: float) -> float:
    return _time(profile, "nvlink", "all_reduce", 8, nbytes) + _time(profile, "ethernet", "all_reduce", 4, nbytes)


def _flat_s(profile, nbytes: float) -> float:
    """One ring over all 32 devices, bounded by the slowest link: Ethernet's latency and bandwidth here."""
    eth, nvl = profile.link("ethernet"), profile.link("nvlink")
    busbw = min(eth.busbw("all_reduce", nbytes), nvl.busbw("all_reduce", nbytes))
    return max(eth.latency_s, nvl.latency_s) + 2 * 31 / 32 * nbytes / busbw


def _hierarchical_s(profile, nbytes: float) -> float:
    """Reduce-scatter on the 8 NVLink devices, all-reduce of 1/8 over Ethernet, all-gather back."""
    return (_time(profile, "nvlink", "reduce_scatter", 8, nbytes)
            + _time(profile, "ethernet", "all_reduce", 4, nbytes / 8)
            + _time(profile, "nvlink", "all_gather", 8, nbytes))


def _kinds(steps):
    return [(s.kind, s.axis) for s in steps]


def test_hierarchical_sum_is_chosen_for_a_large_tensor_on_ethernet_and_nvlink():
    profile = load_profile("ethernet-2node")
    meta = TensorMeta((GIB // 4,), torch.float32)
    steps = cheapest_steps((P, P), (R, R), meta, MESH, profile, grad=False)
    assert _kinds(steps) == [("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    assert [s.message_bytes for s in steps] == [GIB, GIB // 8, GIB]
    exposed, _ = edge_times_s((P, P), (R, R), meta, MESH, profile, training=False, requires_grad=False)
    assert exposed == pytest.approx(_hierarchical_s(profile, GIB), rel=1e-12)
    assert exposed < min(_per_axis_s(profile, GIB), _flat_s(profile, GIB))


def test_a_tiny_tensor_where_latency_dominates_is_summed_flat_not_hierarchically():
    profile = load_profile("ethernet-2node")
    meta = TensorMeta((16,), torch.float32)
    steps = cheapest_steps((P, P), (R, R), meta, MESH, profile, grad=False)
    assert [(s.kind, s.span) for s in steps] == [("all_reduce", (0, 1))]  # one ring over all 32 devices
    assert _flat_s(profile, 64) < _per_axis_s(profile, 64) < _hierarchical_s(profile, 64)
    exposed, _ = edge_times_s((P, P), (R, R), meta, MESH, profile, training=False, requires_grad=False)
    assert exposed == pytest.approx(_flat_s(profile, 64), rel=1e-12)


def test_per_axis_sum_is_kept_where_flat_is_not_offered_and_latency_dominates():
    """On a 3-D mesh summing two of three axes there is no group for a flat ring: per-axis beats hierarchical."""
    profile = load_profile("ethernet-2node")
    mesh = autotp.Mesh((4, 8, 2), names=("dp", "tp", "cp"), links=("ethernet", "nvlink", "nvlink"))
    steps = cheapest_steps((P, P, R), (R, R, R), TensorMeta((16,), torch.float32), mesh, profile, grad=False)
    assert _kinds(steps) == [("all_reduce", 1), ("all_reduce", 0)]
    assert _per_axis_s(profile, 64) < _hierarchical_s(profile, 64)


def test_gradient_sum_over_both_axes_goes_hierarchical_and_stays_overlappable():
    profile = load_profile("ethernet-2node")
    meta = TensorMeta((GIB // 4,), torch.float32)
    steps = cheapest_steps((R, R), (R, R), meta, MESH, profile, grad=True, grad_axes=(0, 1))
    assert [s.forward_kind for s in steps] == [None, None, None]
    backward = [(s.backward_kind, s.axis) for s in reversed(steps)]
    assert backward == [("reduce_scatter", 1), ("all_reduce", 0), ("all_gather", 1)]
    # a parameter's only use: the sum runs in the gradient reducer (a 1 GiB gradient is a bucket of its own)
    exposed, gradient = edge_times_s((R, R), (R, R), meta, MESH, profile, True, True, (0, 1), deferred=True)
    assert exposed == 0.0 and gradient == pytest.approx(_hierarchical_s(profile, GIB), rel=1e-12)


# ---- exact on a 2x2 gloo mesh -------------------------------------------------------------------


def _slow_outer_profile() -> dict:
    """Bandwidth-bound links: Ethernet a million times slower than NVLink, latency negligible."""
    profile = compute_bound_profile()
    for link, busbw in (("ethernet", 1e6), ("nvlink", 1e12)):
        curve = [[1, busbw], [1e12, busbw]]
        profile["links"][link] = {"latency_s": 1e-12, "busbw_Bps": {c: curve for c in COLLECTIVES}, "source": "test"}
    return profile


def _latency_bound_profile() -> dict:
    """Latency-bound links: every collective costs its latency, so one flat ring beats two rings or three steps."""
    profile = compute_bound_profile()
    for link in ("ethernet", "nvlink"):
        profile["links"][link] = {"latency_s": 1e-3, "busbw_Bps": {c: [[1, 1e14], [1e12, 1e14]] for c in COLLECTIVES},
                                  "source": "test"}
    return profile


def _model():
    torch.manual_seed(0)
    return MLP(16, 32, bias=False), (torch.randn(8, 16),)


def _batch_on_both_axes(op, strategy) -> bool:
    """Pure data parallelism on both axes: weights whole, every activation split by batch on dp and tp."""
    if op.kind == KIND_PARAM:
        return strategy.is_replicated
    return strategy.out == (Shard(0), Shard(0))


def _plans(mesh):
    model, inputs = _model()
    # weights split on both axes over the contraction dim: the output is a partial sum on dp and tp
    pin = {"fc1.weight": ("S(0)", "S(0)"), "fc2.weight": ("S(1)", "S(1)")}
    plans = {}
    for form, profile in (("hierarchical", _slow_outer_profile()), ("flat", _latency_bound_profile())):
        plans[f"partial_on_both_axes_{form}"] = autotp.plan(model, mesh, inputs, profile=profile, pin=pin)
        plans[f"data_parallel_2d_{form}"] = autotp.plan(model, mesh, inputs, profile=profile, allow=_batch_on_both_axes)
        plans[f"data_parallel_2d_{form}_in_graph"] = autotp.plan(model, mesh, inputs, profile=profile,
                                                                 allow=_batch_on_both_axes, overlap_gradients=False)
    # a bucket per gradient: the reducer runs several sums of three steps, which every rank must issue alike
    plans["data_parallel_2d_hierarchical_buckets"] = autotp.plan(model, mesh, inputs, profile=_slow_outer_profile(),
                                                                 allow=_batch_on_both_axes, bucket_cap_mb=1e-6)
    return plans


def _reducer_units(plan) -> set:
    """The steps of each gradient sum the lowered program hands its reducer, as (kind, axis) pairs."""
    gm = lower(capture(*_model(), {}), plan, 0)
    return {tuple((kind, comm.name) for kind, comm in e.unit) for e in gm.autotp_reducer.entries}


def _run(rank, world, plans):
    results = {}
    for name, plan in plans.items():
        model, inputs = _model()
        results[name] = max_errors(model, plan, inputs, rank)
    return results


@pytest.fixture(scope="module")
def two_by_two():
    return planned_and_run(_run, _plans, autotp.Mesh((2, 2), names=("dp", "tp"), links=("ethernet", "nvlink")))


def test_plans_use_the_hierarchical_form_and_the_lowered_code_runs_it(two_by_two):
    plans, _ = two_by_two
    row, dp = plans["partial_on_both_axes_hierarchical"], plans["data_parallel_2d_hierarchical"]
    forward = [(c["kind"], c["axis"]) for c in row.collectives if c.get("form") and c["phase"] == "forward"]
    assert forward == [("reduce_scatter", "tp"), ("all_reduce", "dp"), ("all_gather", "tp")]
    grads = [c for c in dp.collectives if c.get("form", "").startswith("grad ")]
    assert {c["producer"] for c in grads} == {"fc1_weight", "fc2_weight"}
    model, inputs = _model()
    code = lower(capture(model, inputs, {}), row, 0).code
    assert "reduce_scatter_tp" in code and "all_reduce_dp" in code and "all_gather_tp" in code
    # the gradient reducer runs the sum in its buckets: reduce-scatter on tp, all-reduce on dp, all-gather on tp
    assert _reducer_units(dp) == {(("reduce_scatter", "tp"), ("all_reduce", "dp"), ("all_gather", "tp"))}
    gm = lower(capture(*_model(), {}), plans["data_parallel_2d_hierarchical_in_graph"], 0)  # or in the graph
    assert "grad_hierarchical_dp_tp_d0" in gm.code
    links = [(kind, comm.name) for kind, comm, _ in gm.grad_hierarchical_dp_tp_d0.links]
    assert links == [("grad_all_gather", "tp"), ("grad_all_reduce", "dp"), ("grad_reduce_scatter", "tp")]


def test_plans_use_the_flat_form_where_latency_dominates_and_the_lowered_code_runs_it(two_by_two):
    plans, _ = two_by_two
    row, dp = plans["partial_on_both_axes_flat"], plans["data_parallel_2d_flat"]
    assert [(c["phase"], c["kind"], c["axis"]) for c in row.collectives if c.get("form")] == [
        ("forward", "all_reduce", "dp+tp")]
    grads = [c for c in dp.collectives if c.get("form")]
    assert {(c["producer"], c["kind"], c["axis"]) for c in grads} == {
        ("fc1_weight", "all_reduce", "dp+tp"), ("fc2_weight", "all_reduce", "dp+tp")}
    assert "self.all_reduce_dp_tp(" in lower(capture(*_model(), {}), row, 0).code
    assert _reducer_units(dp) == {(("all_reduce", "dp_tp"),)}
    assert "self.grad_all_reduce_dp_tp(" in lower(capture(*_model(), {}), plans["data_parallel_2d_flat_in_graph"],
                                                  0).code


def test_hierarchical_sums_are_exact_in_forward_and_backward(two_by_two):
    _, per_rank = two_by_two
    for rank, results in enumerate(per_rank):
        for name, errors in results.items():
            where = f"{name} on 2x2, rank {rank}"
            assert errors["output"] <= TOLERANCE, f"{where}: output error {errors['output']:.2e}"
            assert errors["gradient"] <= TOLERANCE, f"{where}: gradient error {errors['gradient']:.2e}"
            assert errors["parameters"] == 2, where
    assert len(per_rank[0]) == 7
