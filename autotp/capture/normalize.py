"""Graph rewrites that make the captured ATen graph easier to shard, without changing its math.

``linear(x, w, b)`` becomes ``add(linear(x, w), b)`` and ``addmm(b, x, w)``
becomes ``add(mm(x, w), b)``: a bias cannot be added to a partial sum on every
device, so splitting it off lets the planner all-reduce the row-parallel
product first and add the bias once, as Megatron-LM does.

``contiguous(x)`` is dropped: export records it only when the traced strides
need it, which depends on the sizes (CPU attention returns a transposed
layout at some sizes), so keeping it would make the same model's graph differ
between sizes; the lowering turns every ``view`` into ``reshape`` instead.

``mean(x, dims)`` becomes ``sum(x, dims) / count``: a sum over a split dim is a
partial sum, so an RMSNorm over a hidden dim split across devices all-reduces
one number per row instead of gathering the whole activation.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> None:
    """Apply every normalization pass in place."""
    split_linear_bias(gm)
    split_addmm(gm)
    mean_as_sum(gm)
    drop_contiguous(gm)
    gm.graph.lint()
    gm.recompile()


def split_linear_bias(gm: fx.GraphModule) -> None:
    """``linear(x, w, b)`` -> ``add(linear(x, w), b)``, keeping node names and shapes."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.linear.default:
            continue
        if len(node.args) < 3 or node.args[2] is None:
            continue
        x, w, b = node.args[:3]
        with graph.inserting_after(node):
            add = graph.call_function(aten.add.Tensor, (node, b))
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        node.args = (x, w)
        add.meta = dict(node.meta)


def split_addmm(gm: fx.GraphModule) -> None:
    """``addmm(b, x, w)`` (GPT-2's Conv1D) -> ``add(mm(x, w), b)``, for the same reason as linear's bias."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.addmm.default or node.kwargs:
            continue
        b, x, w = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (x, w))
            add = graph.call_function(aten.add.Tensor, (mm, b))
        mm.meta, add.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)


def mean_as_sum(gm: fx.GraphModule) -> None:
    """``mean.dim(x, dims, keepdim)`` -> ``div(sum.dim_IntList(x, dims, keepdim), count)``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.mean.dim or node.kwargs.get("dtype") is not None:
            continue
        x = node.args[0]
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        shape = x.meta["val"].shape
        reduced = range(len(shape)) if not dims else [d % len(shape) for d in dims]
        count = 1
        for d in reduced:
            count *= int(shape[d])
        with graph.inserting_before(node):
            total = graph.call_function(aten.sum.dim_IntList, (x, list(dims or []), keepdim))
            mean = graph.call_function(aten.div.Tensor, (total, count))
        total.meta, mean.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(mean)
        graph.erase_node(node)


def drop_contiguous(gm: fx.GraphModule) -> None:
    """Remove ``aten.contiguous`` (the identity on values); views are lowered as reshapes."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.contiguous.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
