"""Memory per device, by term: parameters, gradients, optimizer state and saved activations.

Counted on local shapes in each tensor's dtype. Training adds a gradient per
parameter and Adam's two fp32 moments; activations are the outputs of
differentiated ops, the upper bound of what autograd saves.
"""

from __future__ import annotations

from autotp.graph.flops import is_alias
from autotp.graph.opgraph import KIND_OP, KIND_PARAM, KIND_BUFFER
from autotp.placement import local_bytes

ADAM_MOMENTS = 2
FP32_BYTES = 4
TERMS = ("parameters", "gradients", "optimizer", "buffers", "activations")


def node_memory_bytes(op, strategy, mesh, training: bool) -> dict[str, int]:
    """Bytes one node keeps on each device under ``strategy``, by term (only the terms it has)."""
    layout = strategy.out
    if op.kind == KIND_PARAM:
        local = local_bytes(op.out[0], layout, mesh.shape)
        if not (training and op.requires_grad):
            return {"parameters": local}
        numel = local // op.out[0].dtype.itemsize
        return {"parameters": local, "gradients": local, "optimizer": ADAM_MOMENTS * FP32_BYTES * numel}
    if op.kind == KIND_BUFFER:
        return {"buffers": local_bytes(op.out[0], layout, mesh.shape)}
    if op.kind == KIND_OP and training and op.requires_grad and not is_alias(op.target):
        return {"activations": sum(local_bytes(m, layout, mesh.shape) for m in op.out)}
    return {}


def memory_by_term(graph, chosen: dict, mesh, training: bool) -> dict[str, int]:
    """Bytes per device for ``chosen`` (node name -> Strategy), split into named terms."""
    terms = dict.fromkeys(TERMS, 0)
    for op in graph.nodes():
        for term, nbytes in node_memory_bytes(op, chosen[op.name], mesh, training).items():
            terms[term] += nbytes
    terms["total"] = sum(terms.values())
    return terms
