"""Cost of moving a tensor from its producer's layout to the layout a consumer needs.

Forward steps always count. In training, when the tensor is differentiated, the
backward duals count too, including the reduction of a partial gradient that a
replicated input receives from split work (Megatron's *f*).

A sum over several mesh axes can run one all-reduce per axis, hierarchically,
or flat over every device (`autotp.redistribute.step_options`);
`cheapest_steps` costs every form, each step on its own axis (a flat step on
its slowest link, `step_time_s`), and keeps the cheapest. The
plan's reported collectives and the lowering use the same choice.
"""

from __future__ import annotations

import math

from autotp.cost.comm import step_time_s
from autotp.redistribute import GRAD_KINDS, Unsupported, step_options


def steps_times_s(steps, mesh, profile, grad: bool, from_parameter: bool = False) -> tuple[float, float]:
    """``(exposed, overlappable)`` seconds of ``steps``; backward duals only when ``grad``.

    The reduction of a parameter's gradient (data parallelism's all-reduce, an
    f step on a parameter, in any form) is overlappable: frameworks run it
    while the backward pass computes earlier layers. Everything else is exposed.
    """
    exposed = sum(step_time_s(s.forward_kind, s, mesh, profile) for s in steps if s.forward_kind)
    overlap = 0.0
    for s in steps if grad else ():
        if s.backward_kind:
            t = step_time_s(s.backward_kind, s, mesh, profile)
            if from_parameter and s.kind in GRAD_KINDS:
                overlap += t
            else:
                exposed += t
    return exposed, overlap


def cheapest_steps(src, dst, meta, mesh, profile, grad: bool, grad_axes=()) -> list:
    """The offered steps from ``src`` to ``dst`` with the least total seconds (ties: one all-reduce per axis).

    ``grad`` says whether the backward runs (training, and the tensor is
    differentiated); ``grad_axes`` count only then. Raises `Unsupported`.
    """
    options = step_options(src, dst, meta, mesh.shape, grad_axes if grad else ())
    return min(options, key=lambda steps: sum(steps_times_s(steps, mesh, profile, grad)))


def edge_times_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=(),
                 from_parameter: bool = False) -> tuple[float, float]:
    """``(exposed, overlappable)`` seconds to turn ``src`` into ``dst``; ``(inf, 0)`` if impossible."""
    grad = training and requires_grad
    try:
        steps = cheapest_steps(src, dst, meta, mesh, profile, grad, grad_axes)
    except Unsupported:
        return math.inf, 0.0
    return steps_times_s(steps, mesh, profile, grad, from_parameter)


def edge_time_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=()) -> float:
    """Seconds to turn ``src`` into ``dst`` (forward, and backward when training); inf if impossible."""
    return sum(edge_times_s(src, dst, meta, mesh, profile, training, requires_grad, grad_axes))
