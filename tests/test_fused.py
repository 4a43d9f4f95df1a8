"""Fused projections: transformers' Falcon (one query_key_value weight, one K/V head) split by heads, exact.

Capture rewrites a projection whose output is only ever cut into parts as one
projection per part, on slices of the one weight (`autotp.capture.fused`).
Falcon's queries then split by heads while its single key and value head stay
whole: on 2 gloo ranks (the suite's time; 2x2 and 4 pass too, run by hand), with dropout 0.1 from the single device's
seed, outputs and every gradient match one device.
"""

from __future__ import annotations

import pytest
import torch

import autotp
import hf_models
from autotp.api import capture_model
from autotp.placement import Shard
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors
from conftest import weights_bound_profile

TOLERANCE = 1e-5
HEADS = 1  # dim of the attention output that holds the heads


def _build():
    return hf_models.build("falcon", dropout=0.1)


def _run(rank, world, plan):
    model, args, kwargs = _build()
    return max_errors(model, plan, args, rank, kwargs=kwargs)


@pytest.fixture(scope="module", params=["2"])
def planned(request):
    model, args, kwargs = _build()
    plan = autotp.plan(model, autotp.Mesh(request.param), args, kwargs, profile=weights_bound_profile())
    return plan, spawn(_run, plan.mesh.size, plan)


def test_attention_splits_by_heads_and_stays_exact(planned):
    plan, per_rank = planned
    attention = [e for e in plan.nodes.values() if e.op.startswith("scaled_dot_product_attention")]
    assert attention and all(Shard(HEADS) in e.out_layout() for e in attention), plan.mesh
    assert not [n for n in plan.fallback_ops if plan.nodes[n].op.split(".")[0] in ("matmul", "numpy_T", "linear")]
    split = [f for f, layout in plan.parameters.items() if any(p != "R" for p in layout)]
    assert any("dense." in f for f in split) and any("dense_h_to_4h" in f for f in split), split
    for rank, err in enumerate(per_rank):
        assert err["output"] <= TOLERANCE and err["gradient"] <= TOLERANCE, (plan.mesh, rank, err)


def test_the_fused_projection_becomes_one_per_part_on_slices_of_its_weight():
    model, args, kwargs = _build()
    gm = capture_model(model, args, kwargs).gm
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.split_with_sizes.default]
    weight = "transformer.h.0.self_attention.query_key_value.weight"
    slices = [n for n in gm.graph.nodes if n.target == torch.ops.aten.slice.Tensor
              and getattr(n.args[0], "target", None) == weight]
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    assert [tuple(n.args[1:]) for n in slices] == [(0, 0, heads * dim), (0, heads * dim, (heads + 1) * dim),
                                                    (0, (heads + 1) * dim, (heads + 2) * dim)]


def test_a_cut_projection_gives_the_same_values_and_gradients():
    """Phi-3's layout, sliced and chunked, as a plain module: the rewritten graph computes what eager does."""
    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.gate_up = torch.nn.Linear(8, 12), torch.nn.Linear(8, 10, bias=False)

        def forward(self, x):
            qkv = self.qkv(x)
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return qkv[..., :6].sum(-1) * qkv[..., 6:9].mean(-1) + (gate * up).sum(-1) + qkv[..., 9:].amax(-1)

    torch.manual_seed(0)
    model, x = Fused(), torch.randn(3, 5, 8)
    gm = capture_model(model, (x,)).gm
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.chunk.default]
    grad = torch.randn(3, 5)
    ours = gm(x)
    torch.testing.assert_close(ours, model(x), rtol=0, atol=1e-6)
    mine = torch.autograd.grad(ours, list(gm.parameters()), grad)
    theirs = torch.autograd.grad(model(x), list(model.parameters()), grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
