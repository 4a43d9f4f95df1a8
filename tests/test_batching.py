"""Opt-in batched and overlapped collectives in the graph: exact on real gloo groups, and really fewer collectives.

`parallelize` runs every collective where the plan uses it by default (as the
cost model prices it), and the gradient sums of data parallelism in the
reducer's buckets (tests/test_reducer.py). Plans made with
``overlap_gradients=False`` keep those sums in the graph, which is where the
batching pass has most to merge: each lowering option (batching and overlap,
on and off) runs the GPT test model's ILP and data-parallel plans made so on
meshes 2 and 2x2; outputs and every parameter gradient are compared with one
device, and the collectives issued are counted with an explicit `CommCounter`.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest

import autotp
from autotp.capture import capture
from autotp.lower.batch_rule import Item, batch_groups
from autotp.lower import lower, shard_tensor
from autotp.lower.batching import BatchStart
from autotp.lower.collectives import CommCounter
from autotp.lower.rewrite import parameter_aliases
from autotp.placement import parse_layout
from autotp.runtime import spawn
from autotp.runtime.groups import mesh_groups
from autotp.runtime.verify import scaled_error
from helpers import forced_plan, make_model

TOLERANCE = 1e-5
OPTIONS = ((False, False), (True, False), (False, True), (True, True))  # (batch_collectives, overlap)


def _errors(plan, rank, groups, captured, batch, overlap) -> dict:
    model, inputs = make_model("gpt")
    reference = copy.deepcopy(model)
    want = reference(*inputs)
    want.backward()
    counter = CommCounter()
    local = lower(copy.deepcopy(captured), plan, rank, groups, batch=batch, overlap=overlap, counter=counter)
    got = local(*inputs)
    got.backward()
    ref = dict(reference.named_parameters())
    grads = []
    for names, param in parameter_aliases(local):
        expected = shard_tensor(ref[names[0]].grad, parse_layout(plan.parameters[names[0]]), plan.mesh.shape,
                                plan.mesh.coords(rank))
        grads.append(scaled_error(param.grad, expected))
    starts = Counter(m.spec.kind for m in local.modules() if isinstance(m, BatchStart))
    return {"output": scaled_error(got, want), "gradient": max(grads), "grads": len(grads),
            "count": counter.count, "bytes": counter.bytes, "starts": starts}


def _run(rank, world, cases):
    """Capture once per rank (export is the slow part) and lower a copy for each case."""
    model, inputs = make_model("gpt")
    captured = capture(model, inputs, {})
    groups = mesh_groups(cases[0][1].mesh)
    return {(kind, opts): _errors(plan, rank, groups, captured, *opts) for kind, plan, opts in cases}


@pytest.fixture(scope="module", params=["2", "2x2"])
def results(request):
    mesh = autotp.Mesh(request.param)
    # on 2: both plans, every option; on 2x2 (4 processes, slower): data parallelism on both axes, both extremes
    kinds, options = (("ilp", "data_parallel"), OPTIONS) if mesh.ndim == 1 else (("data_parallel",), OPTIONS[::3])
    plans = {kind: forced_plan(kind, "gpt", mesh, overlap_gradients=False) for kind in kinds}
    return mesh, spawn(_run, mesh.size, [(k, p, o) for k, p in plans.items() for o in options])


def test_every_option_is_exact(results):
    mesh, per_rank = results
    n_params = len(list(make_model("gpt")[0].parameters()))
    for rank, by_case in enumerate(per_rank):
        for (kind, opts), e in by_case.items():
            where = f"{kind} plan on {mesh}, rank {rank}, batch/overlap {opts}"
            assert e["output"] <= TOLERANCE, f"{where}: output error {e['output']:.2e}"
            assert e["gradient"] <= TOLERANCE, f"{where}: gradient error {e['gradient']:.2e}"
            assert e["grads"] == n_params, where


def test_batching_issues_fewer_collectives_moving_the_same_bytes(results):
    mesh, per_rank = results
    for kind in {k for k, _ in per_rank[0]}:
        plain, batched = per_rank[0][kind, (False, False)], per_rank[0][kind, (True, True)]
        assert batched["count"] < plain["count"], (kind, mesh, plain, batched)
        assert batched["bytes"] == plain["bytes"], (kind, mesh)
        assert not plain["starts"] and batched["starts"]
    # data parallelism reduces the gradient of every parameter (37, 0.1 MiB): at most one bucket per mesh axis
    # (a sum over both axes of 2x2 may run as one all-reduce over their joint group)
    assert 1 <= per_rank[0]["data_parallel", (True, True)]["starts"]["grad_all_reduce"] <= mesh.ndim


def test_overlap_alone_keeps_one_collective_per_step(results):
    mesh, per_rank = results
    if mesh.ndim > 1:
        return  # only meshes of one axis run overlap without batching
    for kind in ("ilp", "data_parallel"):
        assert per_rank[0][kind, (False, True)]["count"] == per_rank[0][kind, (False, False)]["count"]


def test_batch_rule_respects_dependencies_and_cap():
    key = ("all_gather", "tp")
    items = [Item(key, 10, ready=0, needed=5), Item(key, 10, ready=1, needed=6),
             Item(key, 10, ready=5, needed=7),  # its input comes after item 0's consumer
             Item(key, 10, ready=6, needed=8, depends_on=2),  # takes item 2's output
             Item(("all_reduce", "tp"), 10, ready=0, needed=5)]  # another kind
    assert batch_groups(items) == [[0, 1], [4], [2], [3]]
    assert batch_groups(items[:2], cap_bytes=15) == [[0], [1]]


def test_inspection_lowering_without_groups_still_prints():
    model, inputs = make_model("gpt")
    plan = forced_plan("data_parallel", "gpt", autotp.Mesh("2"), overlap_gradients=False)
    local = autotp.parallelize(model, plan, rank=0, groups={}, batch_collectives=True, overlap=True)
    assert "grad_all_reduce_axis0_b0_start" in local.code
    with pytest.raises(RuntimeError, match="no process group"):
        local(*inputs).backward()
