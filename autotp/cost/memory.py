"""Memory per device, by term: parameters, gradients, optimizer state and saved activations.

Counted on local shapes in each tensor's dtype. Training adds a gradient per
parameter and Adam's two fp32 moments; activations are the outputs of
differentiated ops, the upper bound of what autograd saves.
"""

from __future__ import annotations

import math

from autotp.graph.flops import is_alias
from autotp.graph.opgraph import KIND_OP, KIND_PARAM, KIND_BUFFER
from autotp.placement import local_shape

ADAM_MOMENTS = 2
FP32_BYTES = 4


def _local_bytes(meta, layout, mesh_shape) -> int:
    return math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.dtype.itemsize


def memory_by_term(graph, chosen: dict, mesh, training: bool) -> dict[str, int]:
    """Bytes per device for ``chosen`` (node name -> Strategy), split into named terms."""
    terms = {"parameters": 0, "gradients": 0, "optimizer": 0, "buffers": 0, "activations": 0}
    for op in graph.nodes():
        layout = chosen[op.name].out
        if op.kind == KIND_PARAM:
            local = _local_bytes(op.out[0], layout, mesh.shape)
            terms["parameters"] += local
            if training and op.requires_grad:
                terms["gradients"] += local
                numel = math.prod(local_shape(op.out[0].shape, layout, mesh.shape))
                terms["optimizer"] += ADAM_MOMENTS * FP32_BYTES * numel
        elif op.kind == KIND_BUFFER:
            terms["buffers"] += _local_bytes(op.out[0], layout, mesh.shape)
        elif op.kind == KIND_OP and training and op.requires_grad and not is_alias(op.target):
            terms["activations"] += sum(_local_bytes(m, layout, mesh.shape) for m in op.out)
    terms["total"] = sum(terms.values())
    return terms
