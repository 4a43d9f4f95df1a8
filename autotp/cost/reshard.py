"""Cost of moving a tensor from its producer's layout to the layout a consumer needs.

Forward steps always count. In training, when the tensor is differentiated, the
backward duals count too, including the reduction of a partial gradient that a
replicated input receives from split work (Megatron's *f*).
"""

from __future__ import annotations

import math

from autotp.cost.comm import collective_time_s
from autotp.redistribute import GRAD_ALL_REDUCE, Unsupported, plan_steps


def edge_times_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=(),
                 from_parameter: bool = False) -> tuple[float, float]:
    """``(exposed, overlappable)`` seconds to turn ``src`` into ``dst``; ``(inf, 0)`` if impossible.

    The reduction of a parameter's gradient (data parallelism's all-reduce, an
    f step on a parameter) is overlappable: frameworks run it while the
    backward pass computes earlier layers. Everything else is exposed.
    """
    grad = training and requires_grad
    try:
        steps = plan_steps(src, dst, meta, mesh.shape, grad_axes if grad else ())
    except Unsupported:
        return math.inf, 0.0
    exposed = sum(collective_time_s(s.forward_kind, s.axis, s.message_bytes, mesh, profile)
                  for s in steps if s.forward_kind)
    overlap = 0.0
    for s in steps if grad else ():
        if s.backward_kind:
            t = collective_time_s(s.backward_kind, s.axis, s.message_bytes, mesh, profile)
            if from_parameter and s.kind == GRAD_ALL_REDUCE:
                overlap += t
            else:
                exposed += t
    return exposed, overlap


def edge_time_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=()) -> float:
    """Seconds to turn ``src`` into ``dst`` (forward, and backward when training); inf if impossible."""
    return sum(edge_times_s(src, dst, meta, mesh, profile, training, requires_grad, grad_axes))
