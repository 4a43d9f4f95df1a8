"""``parallelize(model, plan, device=...)`` without a weight source: each rank's shards, buffers and the tensors
its program creates go to ``device`` (issue 17: the GPU path).

No GPU runs here, so the meta device stands in for one: transformers' Llama
(real weights on the CPU, which stay there) is lowered with ``device="meta"``
on a mesh of 1, and its program runs on meta inputs. Every parameter and
buffer of the rank module is on meta, and so is its output: a factory op left
on the device the model was captured on (the CPU: rotary positions, the
causal mask) would mix devices and raise. On 2 gloo ranks, the test GPT
lowered with ``device="cpu"`` through the same path matches the single
device's loss and every gradient to 1e-5.
"""

from __future__ import annotations


import autotp
import hf_models
from autotp.runtime import spawn
from autotp.runtime.verify import scaled_error, worst_gradient_error
from conftest import compute_bound_profile
from helpers import make_model

TOLERANCE = 1e-5


def _on_meta(rank, world):
    model, (ids,), kwargs = hf_models.build("llama")
    plan = autotp.plan(model, autotp.Mesh("1"), (ids,), kwargs)
    local = autotp.parallelize(model, plan, device="meta")
    meta_ids = ids.to("meta")
    out = local(meta_ids, labels=meta_ids)
    tensors = list(local.parameters()) + list(local.buffers())
    return {"placed": {str(t.device) for t in tensors}, "output": str(out.loss.device),
            "model_stays": {str(p.device) for p in model.parameters()}}


def _on_cpu(rank, world, plan):
    model, inputs = make_model("gpt")
    reference = make_model("gpt")[0]
    want = reference(*inputs)
    want.backward()
    local = autotp.parallelize(model, plan, device="cpu")
    got = local(*inputs)
    got.backward()
    return {"output": scaled_error(got, want), "gradient": worst_gradient_error(local, reference, plan, rank)}


def test_a_rank_module_placed_on_another_device_creates_its_tensors_there():
    (result,) = spawn(_on_meta, 1)
    assert result == {"placed": {"meta"}, "output": "meta", "model_stays": {"cpu"}}


def test_placing_the_shards_of_the_models_own_weights_is_exact():
    model, inputs = make_model("gpt")
    plan = autotp.plan(model, autotp.Mesh("2"), inputs, profile=compute_bound_profile())
    assert any(p.startswith("S(") for layout in plan.parameters.values() for p in layout)
    for e in spawn(_on_cpu, 2, plan):
        assert e["output"] <= TOLERANCE and e["gradient"] <= TOLERANCE, e
