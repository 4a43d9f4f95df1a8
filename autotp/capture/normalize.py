"""Graph rewrites that make the captured ATen graph easier to shard, without changing its math.

``linear(x, w, b)`` becomes ``add(linear(x, w), b)`` and ``addmm(b, x, w)``
becomes ``add(mm(x, w), b)``: a bias cannot be added to a partial sum on every
device, so splitting it off lets the planner all-reduce the row-parallel
product first and add the bias once, as Megatron-LM does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> None:
    """Apply every normalization pass in place."""
    split_linear_bias(gm)
    split_addmm(gm)
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
