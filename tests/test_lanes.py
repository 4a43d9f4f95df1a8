"""Micro-batch counts searched side by side (`autotp.lanes`): the plan the counts give searched in order.

The GPT test model at batch 16 on a mesh of 4, under limits that make
several counts compete: the likeliest count (16) splits the batch into
more than four micro-batches, so it leads (`autotp.counts.leads`: searched
first without a plan to beat, as in order), and one micro-batch wins where
it fits in a third of the memory its fastest plan needs and loses where it
needs over six times as much. On 2x2 at batch 8 the likeliest (4) does not
lead: one micro-batch is searched first and defers to it. Each is planned with two lanes and with none, and the
plans must be the same in every field the plan is made of. Progress lines
come back whole and prefixed with their count; an error autotp raises in a
lane reaches the caller as itself; a lane that dies, or fails with an
exception of its own, is searched again in the caller, which plans the same;
a lane's failure at a count that cannot win does not fail the plan.
"""

from __future__ import annotations

import io
import os
import re
import time

import pytest
import torch

import autotp
from autotp.api import capture_model
from autotp.cost.memory import most_bytes
from autotp.counts import leads, likely_count
from autotp.errors import MemoryLimitError, PlanError
from autotp.lanes import lane_count
from autotp.progress import Stages
from models import GPT

BATCH = 16


def _make():
    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    return model, (torch.randint(0, 64, (BATCH, 8)), torch.randint(0, 64, (BATCH, 8)))


MESH = autotp.Mesh("4", links="nvlink")


@pytest.fixture(scope="module")
def free():
    model, inputs = _make()
    return autotp.plan(model, MESH, inputs, profile="h100-hgx", workers=1).memory["total"]


def _plan(fraction, free, workers, **kwargs):
    model, inputs = _make()
    return autotp.plan(model, MESH, inputs, profile="h100-hgx", memory_limit=int(free * fraction), workers=workers,
                       **kwargs)


def _same(a, b) -> None:
    assert a.micro_batches == b.micro_batches
    assert a.predicted == b.predicted
    assert a.memory == b.memory
    assert a.parameters == b.parameters and a.nodes == b.nodes
    assert (a.recompute, a.regather) == (b.recompute, b.regather)
    assert _split_state(a) == _split_state(b)


def _split_state(plan) -> list:
    """The shapes of the parameters whose optimizer state is split, with its axes. Which of equal-shaped
    parameters (a norm's weight or its bias) carry that state is a tie of equal step and memory: a lane that
    died is searched again in the caller with the plan to beat of that moment, which depends on which lane
    finished first, and the solver may then break the tie the other way."""
    shapes = {n: tuple(p.shape) for n, p in _make()[0].named_parameters()}
    return sorted((shapes[name], tuple(axes)) for name, axes in plan.optimizer_sharding.items())


@pytest.mark.parametrize("fraction, micro_batches", [(0.15, 4), (0.3, 1)])
def test_counts_side_by_side_plan_as_in_order(free, fraction, micro_batches):
    """16 micro-batches lead; 0.15: one micro-batch is more than 4 times over, and 4 win; 0.3: one micro-batch
    wins."""
    assert leads(list(range(1, BATCH + 1)), BATCH)
    in_order = _plan(fraction, free, workers=1)
    stream = io.StringIO()
    side_by_side = _plan(fraction, free, workers=2, progress=Stages(stream=stream))
    assert in_order.micro_batches == micro_batches and in_order.stats["memory_bound"]  # the counts compete
    _same(side_by_side, in_order)
    lines = stream.getvalue().splitlines()
    searched = {int(m.group(1)) for m in map(re.compile(r"^\[(\d+) micro-batch(?:es)?\] ").match, lines) if m}
    assert {1, side_by_side.micro_batches} <= searched and len(searched) >= 2  # which others: the timing
    assert all(re.fullmatch(r"(\[\d+ micro-batch(es)?\] )?[a-zA-Z ]+… .*\d s", line) for line in lines), lines


def test_nothing_fits_raises_the_same_error(free):
    with pytest.raises(MemoryLimitError) as in_order:
        _plan(0.001, free, workers=1)
    with pytest.raises(MemoryLimitError) as side_by_side:
        _plan(0.001, free, workers=2)
    assert str(side_by_side.value) == str(in_order.value)


def test_an_error_autotp_raises_in_a_lane_reaches_the_caller(free):
    with pytest.raises(PlanError, match="recompute='sometimes'"):
        _plan(0.15, free, workers=2, recompute="sometimes")


def test_a_lane_that_dies_or_fails_is_searched_again_in_the_caller(free):
    """The lanes of counts 2 and 4 die as if killed, that of 8 raises an error of its own: each is searched
    again in the planning process, where nothing fails, and the plan is the one made in order."""
    planner = os.getpid()

    def allow(op, strategy):
        if os.getpid() != planner and op.name == "embedding":  # only in a lane
            k = BATCH // op.out[0].shape[0]
            if k in (2, 4):
                os._exit(3)
            if k == 8:
                raise RuntimeError("a failure of the lane's own")
        return True

    stream = io.StringIO()
    side_by_side = _plan(0.15, free, workers=2, allow=allow, progress=Stages(stream=stream))
    _same(side_by_side, _plan(0.15, free, workers=1, allow=allow))
    again = [line for line in stream.getvalue().splitlines() if line.startswith("enumerating strategies")]
    assert len(again) == 3  # 2, 4 and 8 micro-batches, searched again here


def test_an_error_at_a_count_that_cannot_win_is_dropped(free, tmp_path):
    """Under half as much again as it needs, one micro-batch fits as it is, so no other count can win, and the
    search in order never reaches them: that their lanes fail (as batch norm fails on a micro-batch of one
    sample) must not fail the plan. The first count's lane holds on until another has failed, so the failure
    always comes first."""
    planner, failed = os.getpid(), tmp_path / "failed"

    def allow(op, strategy):
        if os.getpid() != planner and op.name == "embedding":  # only in a lane
            if op.out[0].shape[0] < BATCH:
                failed.touch()
                raise PlanError("this count cannot be planned")
            deadline = time.monotonic() + 60
            while not failed.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return True

    side_by_side = _plan(1.5, free, workers=2, allow=allow)
    assert failed.exists()
    in_order = _plan(1.5, free, workers=1, allow=allow)
    assert in_order.micro_batches == 1 and not in_order.stats["memory_bound"]
    _same(side_by_side, in_order)


def test_a_limit_that_cannot_bind_searches_one_count_here(free):
    """Under the default limit (80 GB) every tensor of the small GPT's step, unsharded, fits many times over:
    no lane is forked (no progress line carries a count). The bound is above what every plan keeps, with each
    lever on or off, memory bound or not."""
    model, inputs = _make()
    stream = io.StringIO()
    plan = autotp.plan(model, MESH, inputs, profile="h100-hgx", workers=2, progress=Stages(stream=stream))
    assert plan.micro_batches == 1 and "micro-batch" not in stream.getvalue()
    bound = most_bytes(capture_model(model, inputs).graph, training=True)
    levers = [{}, {"optimizer_sharding": False, "recompute": False, "regather": False}, {"precision": "fp32"}]
    for memory_limit in (None, int(free * 0.5)):
        for options in levers:
            chosen = autotp.plan(model, MESH, inputs, profile="h100-hgx", workers=1, micro_batches=1,
                                 memory_limit=memory_limit, **options)
            assert 0 < chosen.memory["total"] <= bound


def test_lane_count():
    assert lane_count(2, 1) == 1  # one count: nothing to share
    assert lane_count(8, 3) == 3
    assert lane_count("auto", 6) >= 1
    for bad in (0, -1, "two", True, 1.5):
        with pytest.raises(PlanError, match="workers="):
            lane_count(bad, 4)


def test_counts_side_by_side_plan_as_in_order_where_one_micro_batch_defers():
    """On 2x2 at batch 8 the likeliest count is 4 (two samples a data-parallel replica): too few to lead. One
    micro-batch is searched first, needs over four times a fifth of its fastest plan's memory, and defers to 4,
    which wins; then one micro-batch is searched again, against 4's plan. Four micro-batches hold plans as fast
    as each other to the solver's tolerance (1e-10), and the lanes hear of 4's plan when its search proves it
    (`found`), so which of them comes back depends on the timing: the same count, as fast."""
    mesh = autotp.Mesh("2x2", links="infiniband,nvlink")

    def plan(**kwargs):
        torch.manual_seed(0)
        model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
        return autotp.plan(model, mesh, (torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))),
                           profile="h100-hgx", **kwargs)

    counts = [1, 2, 4, 8]
    assert likely_count(counts, mesh, 8) == 4 and not leads(counts, 4)
    limit = int(plan(workers=1).memory["total"] * 0.2)
    stream = io.StringIO()
    side_by_side = plan(memory_limit=limit, workers=2, progress=Stages(stream=stream))
    in_order = plan(memory_limit=limit, workers=1)
    assert in_order.micro_batches == side_by_side.micro_batches == 4 and in_order.stats["memory_bound"]
    assert side_by_side.predicted["total_s"] == pytest.approx(in_order.predicted["total_s"], rel=1e-9)
    solves = [line for line in stream.getvalue().splitlines() if line.startswith("[1 micro-batch] solving ILP")]
    assert len(solves) == 2  # deferred, then searched against 4's plan


def test_the_second_capture_made_beside_the_first_comes_back_whole():
    """`autotp.capture.beside`: a capture made in a forked process sends back its graph node for node (torch's
    operators the very objects of this process), its progress line, time and what it replayed; one that fails
    sends nothing, and `autotp.api._Captures` then captures here, where the error has its traceback."""
    from autotp.capture.beside import Beside

    model, inputs = _make()
    stream = io.StringIO()
    here = capture_model(model, inputs, progress=Stages(stream=stream))

    def capture():
        lines = io.StringIO()
        stages = Stages(stream=lines)
        captured = capture_model(model, inputs, progress=stages)
        return captured, lines.getvalue(), stages.times["capturing"]

    graph, lines, seconds, report = Beside(capture).result()
    assert graph.order == here.graph.order and graph.outputs == here.graph.outputs
    for name in here.graph.order:
        assert graph.node(name) == here.graph.node(name)
        if isinstance(here.graph.node(name).target, torch._ops.OpOverload):
            assert graph.node(name).target is here.graph.node(name).target
    assert sorted(graph.graph.edges(data=True)) == sorted(here.graph.graph.edges(data=True))
    assert lines.startswith("capturing… ") and lines.endswith(f", {seconds:.1f} s\n")
    assert lines.rsplit(", ", 1)[0] == stream.getvalue().rsplit(", ", 1)[0]  # the same ops, the same replay
    assert seconds > 0 and report == here.gm.meta["autotp_capture"]

    def fails():
        raise RuntimeError("no capture")

    assert Beside(fails).result() is None
