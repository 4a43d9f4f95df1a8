"""Cost of moving a tensor from its producer's layout to the layout a consumer needs.

Forward steps always count. In training, when the tensor is differentiated, the
backward duals count too, plus the all-reduce of a partial gradient that a
replicated input receives from split work (Megatron's *f*).
"""

from __future__ import annotations

import math

from autotp.cost.comm import collective_time_s
from autotp.placement import local_shape
from autotp.redistribute import ALL_REDUCE, Unsupported, plan_steps


def grad_allreduce_bytes(meta, layout, mesh_shape) -> int:
    return math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.dtype.itemsize


def edge_time_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=()) -> float:
    """Seconds to turn ``src`` into ``dst`` (forward, and backward when training); inf if impossible."""
    try:
        steps = plan_steps(src, dst, meta, mesh.shape)
    except Unsupported:
        return math.inf
    total = sum(collective_time_s(s.kind, s.axis, s.message_bytes, mesh, profile) for s in steps)
    if training and requires_grad:
        total += sum(collective_time_s(s.backward_kind, s.axis, s.message_bytes, mesh, profile)
                     for s in steps if s.backward_kind)
        grad_bytes = grad_allreduce_bytes(meta, dst, mesh.shape)
        total += sum(collective_time_s(ALL_REDUCE, a, grad_bytes, mesh, profile) for a in grad_axes)
    return total
