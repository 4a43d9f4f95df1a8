"""Graph rewrites that make the captured ATen graph easier to shard, without changing its math.

``linear(x, w, b)`` becomes ``add(linear(x, w), b)``: a bias cannot be added to a
partial sum on every device, so splitting it off lets the planner all-reduce the
row-parallel product first and add the bias once, as Megatron-LM does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> None:
    """Apply every normalization pass in place."""
    split_linear_bias(gm)
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
