"""The explicit registry of strategy rules, keyed by ATen op.

`default_registry()` builds a fresh dict each call; nothing is registered by
import side effects, and a caller may pass its own registry to `plan()`.
An op with no entry is replicated and reported in ``plan.fallback_ops``.
"""

from __future__ import annotations

import operator

import torch

from autotp.capture.experts import EXPERTS
from autotp.strategies import (attention, conv, embedding, experts, inplace, loss, matmul, norms, pointwise, pooling,
                               reductions, views)
from autotp.strategies.base import RuleEntry

aten = torch.ops.aten

_UNARY = ("gelu", "relu", "silu", "tanh", "sigmoid", "exp", "log", "rsqrt", "sqrt", "abs", "sin", "cos",
          "erf", "reciprocal", "square")
_LINEAR_UNARY = ("neg", "clone", "contiguous", "alias", "detach", "_to_copy", "lift_fresh_copy")


def _overloads(name: str):
    packet = getattr(aten, name, None)
    return [getattr(packet, o) for o in packet.overloads()] if packet is not None else []


def default_registry() -> dict:
    """A new mapping ``OpOverload -> RuleEntry`` covering the supported op families."""
    reg: dict = {}

    def add(names, fn):
        for name in names:
            for overload in _overloads(name):
                reg[overload] = RuleEntry(fn)

    add(["linear"], matmul.linear_rule)
    add(["mm"], matmul.mm_rule)
    add(["bmm"], matmul.bmm_rule)
    add(["matmul"], matmul.matmul_rule)
    add(_UNARY + ("dropout", "feature_dropout", "pow", "rand_like", "randn_like"), pointwise.unary_rule)
    reg[aten.bernoulli.p] = RuleEntry(pointwise.unary_rule)  # a fixed p: the values drawn ignore the input's
    add(_LINEAR_UNARY + ("to", "type_as"), pointwise.linear_unary_rule)
    add(["add", "sub"], pointwise.add_rule)
    add(["mul"], pointwise.mul_rule)
    add(["div"], pointwise.div_rule)
    add(["where", "masked_fill", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__",
         "logical_not", "bitwise_not"], pointwise.unary_rule)
    add(["_softmax", "softmax", "_log_softmax", "log_softmax"], norms.softmax_rule)
    add(["layer_norm"], norms.layer_norm_rule)
    add(["view", "reshape", "_unsafe_view"], views.view_rule)
    add(["flatten"], views.flatten_rule)
    add(["select"], views.select_rule)
    add(["transpose"], views.transpose_rule)
    add(["permute"], views.permute_rule)
    add(["t"], views.t_rule)
    add(["numpy_T"], views.numpy_t_rule)
    add(["unsqueeze"], views.unsqueeze_rule)
    add(["expand"], views.expand_rule)
    add(["slice"], views.slice_rule)
    add(["pad", "constant_pad_nd"], views.pad_rule)
    add(["split", "split_with_sizes", "chunk"], views.split_rule)
    add(["cat"], views.cat_rule)
    reg[operator.getitem] = RuleEntry(views.getitem_rule)
    add(["scaled_dot_product_attention"], attention.sdpa_rule)
    add(["embedding"], embedding.embedding_rule)
    add(["sum"], reductions.sum_rule)
    add(["mean"], reductions.mean_rule)
    add(["cross_entropy_loss"], loss.cross_entropy_rule)
    add(["conv2d"], conv.conv_rule)
    add(["batch_norm"], norms.batch_norm_rule)
    for spatial in (1, 2, 3):
        add([f"max_pool{spatial}d", f"max_pool{spatial}d_with_indices", f"avg_pool{spatial}d",
             f"adaptive_avg_pool{spatial}d", f"_adaptive_avg_pool{spatial}d"], pooling.pool_rule(spatial))
    add(["argmax", "argmin", "amax", "amin", "logsumexp", "var", "std", "var_mean", "std_mean"],
        reductions.dim_reduction_rule)
    for overload in (aten.max.dim, aten.min.dim, aten.max.default, aten.min.default):
        reg[overload] = RuleEntry(reductions.dim_reduction_rule)
    for overload in (aten.max.other, aten.min.other):
        reg[overload] = RuleEntry(pointwise.unary_rule)
    add(["topk", "sort", "cumsum", "cumprod"], reductions.along_dim_rule)
    add(inplace.INPLACE_UPDATES, inplace.in_place_update_rule)
    add(["index_copy_"], inplace.index_copy_rule)
    reg[EXPERTS] = RuleEntry(experts.experts_rule)
    return reg
