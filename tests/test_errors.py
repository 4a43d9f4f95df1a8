"""Errors that name the problem and the way out: pins, plans that do not fit, process groups."""

from __future__ import annotations

import pytest

import autotp
from autotp.errors import MeshError, PlanError
from autotp.runtime import spawn
from helpers import make_model
from models import MLP


def test_impossible_pin_lists_what_is_possible():
    model, inputs = make_model("mlp")
    with pytest.raises(PlanError, match=r"S\(2\).*not possible.*possible: \['R', 'S\(0\)', 'S\(1\)'\]"):
        autotp.plan(model, autotp.Mesh("2"), inputs, pin={"fc1.weight": ("S(2)",)})
    with pytest.raises(PlanError, match="'fc9.weight' is not in the model"):
        autotp.plan(model, autotp.Mesh("2"), inputs, pin={"fc9.weight": ("R",)})


def test_plan_for_another_model_is_refused():
    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs, training=False)
    other = MLP(16, 32, bias=False)
    from autotp.capture import capture
    from autotp.lower import lower

    with pytest.raises(PlanError, match="re-plan"):
        lower(capture(other, inputs), plan, rank=0)


def _parallelize_on_wrong_world(rank, world, plan):
    model, _ = make_model("mlp")
    try:
        autotp.parallelize(model, plan)
    except MeshError as exc:
        return str(exc)
    return "no error"


def test_mesh_larger_than_process_group():
    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("4"), inputs)
    messages = spawn(_parallelize_on_wrong_world, 2, plan)
    assert all("has 4 devices but the process group has 2 ranks" in m for m in messages), messages


def test_parallelize_without_process_group():
    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs)
    with pytest.raises(MeshError, match="init_process_group"):
        autotp.parallelize(model, plan)
