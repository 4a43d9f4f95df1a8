"""Cost of moving a tensor from its producer's layout to the layout a consumer needs.

Forward steps always count. In training, when the tensor is differentiated, the
backward duals count too, including the reduction of a partial gradient that a
replicated input receives from split work (Megatron's *f*).
"""

from __future__ import annotations

import math

from autotp.cost.comm import collective_time_s
from autotp.redistribute import Unsupported, plan_steps


def edge_time_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=()) -> float:
    """Seconds to turn ``src`` into ``dst`` (forward, and backward when training); inf if impossible."""
    grad = training and requires_grad
    try:
        steps = plan_steps(src, dst, meta, mesh.shape, grad_axes if grad else ())
    except Unsupported:
        return math.inf
    total = sum(collective_time_s(s.forward_kind, s.axis, s.message_bytes, mesh, profile)
                for s in steps if s.forward_kind)
    if grad:
        total += sum(collective_time_s(s.backward_kind, s.axis, s.message_bytes, mesh, profile)
                     for s in steps if s.backward_kind)
    return total
