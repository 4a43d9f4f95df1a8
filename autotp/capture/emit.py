"""Inserting an op into a captured graph with its output's shape recorded, as export records it."""

from __future__ import annotations

import torch
import torch.fx as fx


def meta_value(gm: fx.GraphModule, arg):
    """A ``meta``-device stand-in for an fx argument, so an op's output shape can be computed."""
    if not isinstance(arg, fx.Node):
        return arg
    val = arg.meta.get("val")
    if val is None and arg.op == "get_attr":
        val = getattr(gm, "get_parameter" if arg.target in dict(gm.named_parameters()) else "get_buffer")(arg.target)
    if isinstance(val, torch.Tensor):
        return torch.empty(val.shape, dtype=val.dtype, device="meta")
    return val


def emit(gm: fx.GraphModule, target, *args, like: fx.Node | None = None, **kwargs) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with its output recorded in ``meta['val']``
    (``like``: a node whose other metadata it takes)."""
    node = gm.graph.call_function(target, args, kwargs)
    if like is not None:
        node.meta = dict(like.meta)  # where it comes from (module scope, source line), for scopes and errors
    margs, mkwargs = torch.utils._pytree.tree_map(lambda a: meta_value(gm, a), (args, kwargs))
    node.meta["val"] = target(*margs, **mkwargs)
    return node
