"""Hugging Face tp_plan and DTensor parallelize_module plans: imported as pins, exported from plans."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autotp
import hf_models
from autotp.interop import dtensor_plan, hf_tp_plan_pins, pins_from_styles, styles_from_plan
from conftest import compute_bound_profile
from helpers import make_model


def test_hf_tp_plan_round_trips_through_a_plan():
    model, args, kwargs = hf_models.build("llama")
    pins = hf_tp_plan_pins(model)
    assert pins["model.layers.0.self_attn.q_proj.weight"] == ("S(0)",)
    assert pins["model.layers.1.mlp.down_proj.weight"] == ("S(1)",)
    assert pins["lm_head.weight"] == ("S(0)",) and pins["model.norm.weight"] == ("R",)
    assert pins["model.embed_tokens.weight"] == ("S(0)",)  # embedding_rowwise: split over the vocabulary
    plan = autotp.plan(model, autotp.Mesh("2"), args, kwargs, pin=pins)
    styles = styles_from_plan(plan, model)
    # transformers' full plan: its own names for the vocabulary-split embedding and the gathered LM head
    hf = {k: {"embedding_rowwise": "rowwise", "colwise_gather_output": "colwise"}.get(v, v)
          for k, v in model._tp_plan.items()}
    assert styles == hf


def test_styles_on_a_2d_mesh_pin_the_last_axis():
    model, _ = make_model("mlp")
    pins = pins_from_styles(model, {"fc1": "colwise", "fc2": "rowwise"}, mesh_ndim=2)
    assert pins == {"fc1.weight": ("R", "S(0)"), "fc1.bias": ("R", "S(0)"),
                    "fc2.weight": ("R", "S(1)"), "fc2.bias": ("R", "R")}


def test_dtensor_export_names_every_split_module():
    model, inputs = make_model("gpt")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs, profile=compute_bound_profile(),
                       pin=pins_from_styles(model, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}))
    exported = dtensor_plan(plan, model)
    assert isinstance(exported["blocks.0.up"], ColwiseParallel)
    assert isinstance(exported["blocks.1.down"], RowwiseParallel)
    assert styles_from_plan(plan, model)["blocks.*.up"] == "colwise"
