"""Errors that name the problem and the way out: pins, plans that do not fit, process groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture, inputs_from_specs
from autotp.errors import CaptureError, DtypeError, InputError, MemoryLimitError, MeshError, PlanError, ProfileError
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


def _error_text(call, error) -> str:
    """What ``call()`` raises of ``error``, as a rank returns it, or ``"no error"``."""
    try:
        call()
    except error as exc:
        return str(exc)
    return "no error"


def _parallelize_on_wrong_world(rank, world, plan):
    model, _ = make_model("mlp")
    return _error_text(lambda: autotp.parallelize(model, plan), MeshError)


def test_mesh_larger_than_process_group():
    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("4"), inputs)
    messages = spawn(_parallelize_on_wrong_world, 2, plan)
    assert all("has 4 devices but the process group has 2 ranks: plan for Mesh('2'), launch 4 processes" in m
               for m in messages), messages


def test_parallelize_without_process_group():
    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs)
    with pytest.raises(MeshError, match="init_process_group"):
        autotp.parallelize(model, plan)


def _lower_one_capture_twice(rank, world, model, plan):
    from autotp.api import capture_for

    captured = capture_for(model, plan)
    autotp.parallelize(model, plan, captured=captured)
    return _error_text(lambda: autotp.parallelize(model, plan, captured=captured), PlanError)


def test_a_capture_is_lowered_for_its_own_model_once():
    from autotp.api import capture_for

    model, inputs = make_model("mlp")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs)
    with pytest.raises(PlanError, match="not this model's"):
        autotp.parallelize(make_model("mlp")[0], plan, captured=capture_for(model, plan))
    messages = spawn(_lower_one_capture_twice, 2, model, plan)
    assert all("lowered already" in m and "capture_for(model, plan)" in m for m in messages), messages


def test_memory_limit_no_plan_meets():
    model, inputs = make_model("mlp")
    with pytest.raises(MemoryLimitError, match=r"no plan fits 1.0 KiB per device.*smallest any plan reaches is .*"
                                               r"raise memory_limit or "):
        autotp.plan(model, autotp.Mesh("2"), inputs, memory_limit="1KiB")


def test_profile_missing_field_is_named():
    from conftest import compute_bound_profile

    profile = compute_bound_profile()
    del profile["device"]["peak_flops"]
    model, inputs = make_model("mlp")
    with pytest.raises(ProfileError, match=r"missing field device\.peak_flops; see docs/cost-model\.md"):
        autotp.plan(model, autotp.Mesh("2"), inputs, profile=profile)


def test_unsupported_dtypes_are_named_where_first_met():
    model, inputs = make_model("mlp")
    with pytest.raises(DtypeError, match=r"MLP's 'fc1\.weight' has dtype complex64.*supported: float64.*convert it"):
        capture(model.to(torch.complex64), (inputs[0].to(torch.complex64),))
    model, inputs = make_model("mlp")
    with pytest.raises(DtypeError, match=r"example input #0 has dtype float8_e4m3fn.*convert it"):
        capture(model, (inputs[0].to(torch.float8_e4m3fn),))
    with pytest.raises(DtypeError, match=r"op aten\.view_as_complex.*test_errors\.py.*view_as_complex.*complex64"
                                         r".*rewrite that line with real tensors"):
        capture(ComplexInside(), (torch.randn(2, 4),))


def test_dtype_typo_in_a_plan_is_named():
    model, inputs = make_model("mlp")
    specs = autotp.plan(model, autotp.Mesh("2"), inputs).inputs
    specs["args"][0]["dtype"] = "flaot32"
    with pytest.raises(DtypeError, match=r"unknown dtype 'flaot32' in the plan's example inputs; use one of: float64"):
        inputs_from_specs(specs)


def test_inputs_that_do_not_match_forward():
    model, inputs = make_model("mlp")
    with pytest.raises(InputError, match=r"example inputs \(none\) do not match MLP\.forward\(x\): missing a "
                                         r"required argument: 'x'; pass one example per argument"):
        autotp.plan(model, autotp.Mesh("2"), ())
    with pytest.raises(InputError, match=r"too many positional arguments"):
        capture(model, inputs + inputs)
    with pytest.raises(InputError, match=r"example inputs \(float32\[8, 17\]\) do not fit MLP: .*\[8, 17\].*"
                                         r"models\.py:\d+.*Pass inputs of the shapes and dtypes forward\(\) expects"):
        capture(model, (torch.randn(8, 17),))


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class ToNumpy(nn.Module):
    def forward(self, x):
        return x + torch.from_numpy(x.detach().numpy())


class ScaleByItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) / x.abs().max().item()


class ComplexInside(nn.Module):
    def forward(self, x):
        return torch.view_as_real(torch.view_as_complex(x.view(2, 2, 2)) ** 2).view(2, 4)


def test_uncapturable_model_names_the_line_and_the_fix():
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"could not capture Branchy: .*data-dependent.*test_errors\.py:\d+ "
                                           r"\(if x\.sum\(\) > 0:\).*torch\.where"):
        capture(Branchy(), (x,))
    with pytest.raises(CaptureError, match=r"could not capture ToNumpy: .*numpy.*\(return x \+ torch\.from_numpy.*"
                                           r"with torch ops"):
        capture(ToNumpy(), (x,))
    plan = autotp.plan(ScaleByItem(), autotp.Mesh("2"), (x,))  # .item() is captured as a symbolic scalar
    assert set(plan.parameters) == {"fc.weight", "fc.bias"}
