"""What an op computes, without its name: the key under which identical ops share work.

Strategy rules and cost functions are pure functions of an `OpNode`'s content
(its target, arguments with shapes, and dtypes), never of its name or its
place in the graph. Two ops with the same signature therefore have the same
strategies and the same costs, which is what lets the 80 layers of a Llama
be enumerated, costed and solved once (`autotp.solve.layers`).
"""

from __future__ import annotations

from autotp.graph.opgraph import KIND_OP, OpNode, module_layer


def op_signature(op: OpNode) -> tuple:
    """A hashable key equal for two ops exactly when every rule and cost sees them alike."""
    kwargs = tuple(sorted((k, repr(v)) for k, v in op.kwargs.items()))
    target = str(op.target) if op.kind == KIND_OP else None  # a parameter's target is its name
    return (op.kind, target, repr(op.args), kwargs, op.in_metas, op.out, op.multi_output,
            op.requires_grad, len(op.inputs), op.saves_inputs, op.keeps_output, op.saved_extra)


def layer_path(op: OpNode) -> str | None:
    """``"model.layers.3"``: the module path of the layer an op belongs to (`layer_of`), or None."""
    where = layer_of(op)
    return None if where is None else f"{where[0]}.{where[1]}"


def layer_of(op: OpNode) -> tuple[str, int] | None:
    """``("model.layers", 3)`` for an op or parameter of ``model.layers.3``; None outside a layer list
    (`autotp.graph.opgraph.module_layer`)."""
    return module_layer(op.module)
