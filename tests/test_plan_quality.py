"""Plan quality on Llama at scale (meta device, mesh 8, H100 profile) against Hugging Face's own plan.

Hugging Face's own plan (q/k/v/gate/up colwise, o/down rowwise, the embedding
split over the vocabulary, lm_head colwise) is imported as pinned placements
(`autotp.interop.hf_tp_plan_pins`) and costed by the same model; autotp's plan must be predicted no slower. With few tokens per step
(weights dominate) the plan is Megatron's, two all-reduces per layer in
forward, or with collective matmuls (the default) its sequence-parallel form,
a reduce-scatter after each row-parallel projection and an all-gather before
each column-parallel one, which the projections hide; with long sequences autotp keeps the residual stream split between
the blocks (no large all-reduce at all), which costs at most the bytes of the
two all-reduces and less compute: it may even run a block data-parallel over
the sequence, its weights' gradient sums hidden behind the backward pass.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import autotp
from autotp.interop import hf_tp_plan_pins

LAYERS = 2


def _llama(tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=LAYERS,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


@pytest.fixture(scope="module", params=[128, 2048])
def plans(request):
    model, args, kwargs = _llama(request.param)
    mesh = autotp.Mesh("8")
    auto = autotp.plan(model, mesh, args, kwargs)
    hf = autotp.plan(model, mesh, args, kwargs, pin=hf_tp_plan_pins(model))
    return request.param, auto, hf


def test_autotp_is_no_slower_than_hf_tp_plan(plans):
    tokens, auto, hf = plans
    assert auto.predicted["objective_s"] <= hf.predicted["objective_s"] * (1 + 1e-9), (tokens, auto.predicted,
                                                                                       hf.predicted)
    assert auto.predicted["total_s"] <= hf.predicted["total_s"] * (1 + 1e-9)


def test_layer_collectives(plans):
    tokens, auto, _ = plans
    forward = auto.forward_collectives()
    in_layers = [c for c in forward if not c["node"].startswith(("cross_entropy", "output"))]
    loss = [c for c in forward if c["node"].startswith("cross_entropy")]
    if tokens == 128:  # the logits come back whole (only a split of the rows stays split), so the loss
        # runs on them as on one device: one all-gather of the vocabulary-split logits, nothing in the loss
        assert loss == []
        logits = [c for c in forward if c["bytes"] == tokens * 32000 * 4]
        assert [c["kind"] for c in logits] == ["all_gather"]
        in_layers = [c for c in in_layers if c not in logits]
    else:  # the LM head runs data-parallel over the sequence, and so does the loss: the sum and the count
        assert [(c["kind"], c["bytes"]) for c in loss] == [("all_reduce", 8)]
    if tokens == 128:
        # Megatron: q/k/v/gate/up column, o/down row, one all-reduce after each row-parallel projection, or
        # (sequence parallelism, the collectives run inside the projections) a reduce-scatter after each and an
        # all-gather before each column-parallel block, and one more before the LM head
        for i in range(LAYERS):
            for name in ("q_proj", "k_proj", "v_proj"):
                assert auto.parameters[f"model.layers.{i}.self_attn.{name}.weight"] == ("S(0)",)
            assert auto.parameters[f"model.layers.{i}.self_attn.o_proj.weight"] == ("S(1)",)
            assert auto.parameters[f"model.layers.{i}.mlp.down_proj.weight"] == ("S(1)",)
        kinds = Counter(c["kind"] for c in in_layers)
        sequence_parallel = Counter({"reduce_scatter": 2 * LAYERS, "all_gather": 2 * LAYERS + 1})
        assert kinds in (Counter({"all_reduce": 2 * LAYERS}), sequence_parallel), kinds
        assert (kinds == sequence_parallel) == (auto.predicted["overlap_hidden_s"] > 0)
    else:
        # the residual stream stays split: per layer the large collectives move the bytes of two all-reduces
        hidden_bytes = tokens * 4096 * 4
        big = [c for c in in_layers if c["bytes"] >= hidden_bytes]
        assert all(c["kind"] in ("all_gather", "reduce_scatter") and c["bytes"] == hidden_bytes for c in big)
        # at most per layer: (gather, gather) around attention, (gather, reduce-scatter) around the MLP;
        # then one gather of the final norm's output into the vocabulary-split LM head
        assert 0 < len(big) <= 4 * LAYERS + 1
