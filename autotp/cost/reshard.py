"""Cost of moving a tensor from its producer's layout to the layout a consumer needs.

Forward steps always count. In training, when the tensor is differentiated, the
backward duals count too, including the reduction of a partial gradient that a
replicated input receives from split work (Megatron's *f*).

A sum over several mesh axes can run one all-reduce per axis, hierarchically,
or flat over every device (`autotp.redistribute.step_options`);
`cheapest_steps` costs every form, each step on its own axis (a flat step on
its slowest link), and keeps the cheapest. The plan's reported collectives
and the lowering use the same choice.

A *deferred* edge is a parameter's only edge whose steps are a pure gradient
sum (`autotp.redistribute.is_gradient_sum`): the runtime buckets it and runs
it behind the backward pass, as DDP does. Its time is reported apart, as the
``gradient`` part, at the bucket's latency share and bandwidth
(`autotp.cost.comm.bucketed_step_time_s`); the step model
(`autotp.solve.chain`) decides how much of it the backward compute hides.
"""

from __future__ import annotations

import math

from autotp.cost.collective_matmul import lone_collective
from autotp.cost.comm import DEFAULT_BUCKET_BYTES, bucketed_step_time_s, step_time_s
from autotp.redistribute import Unsupported, gathers, is_gradient_sum, options_key, step_options


def step_seconds(steps, mesh, profile, grad: bool, deferred: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[list[float], list[float], bool]:
    """``(forward seconds per step, backward seconds per step, bucketed)``; backward only when ``grad``.

    A ``deferred`` edge whose steps are a pure gradient sum is priced at the
    bucket's rates and marked ``bucketed``; it runs behind the backward pass.
    """
    forward = [step_time_s(s.forward_kind, s, mesh, profile) if s.forward_kind else 0.0 for s in steps]
    if not grad:
        return forward, [0.0] * len(steps), False
    bucketed = deferred and is_gradient_sum(steps, mesh.shape)
    size = max((s.message_bytes for s in steps if s.backward_kind), default=0)
    backward = [0.0 if not s.backward_kind
                else bucketed_step_time_s(s.backward_kind, s, size, mesh, profile, bucket_bytes) if bucketed
                else step_time_s(s.backward_kind, s, mesh, profile) for s in steps]
    return forward, backward, bucketed


def steps_times_s(steps, mesh, profile, grad: bool, deferred: bool = False,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[float, float]:
    """``(exposed, gradient)`` seconds of ``steps``; backward duals only when ``grad``.

    ``gradient`` is non-zero only for a ``deferred`` edge whose steps are a
    pure gradient sum; everything else is on the critical path.
    """
    return _split(*step_seconds(steps, mesh, profile, grad, deferred, bucket_bytes))


def _split(forward: list[float], backward: list[float], bucketed: bool) -> tuple[float, float]:
    """`step_seconds`'s as `steps_times_s`'s ``(exposed, gradient)``."""
    return (sum(forward), sum(backward)) if bucketed else (sum(forward) + sum(backward), 0.0)


def cheapest_steps(src, dst, meta, mesh, profile, grad: bool, grad_axes=(), deferred: bool = False,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    """The offered steps from ``src`` to ``dst`` with the least total seconds (ties: one all-reduce per axis).

    ``grad`` says whether the backward runs (training, and the tensor is
    differentiated); ``grad_axes`` count only then. Raises `Unsupported`.
    """
    return _cheapest(src, dst, meta, mesh, profile, grad, grad_axes, deferred, bucket_bytes)[0]


def _cheapest(src, dst, meta, mesh, profile, grad: bool, grad_axes, deferred: bool, bucket_bytes: int) -> tuple:
    """`cheapest_steps`, and their `step_seconds`: each option is priced once (`edge_cost` priced the one it
    kept twice more, a third of a costing's redistribution time)."""
    options = step_options(src, dst, meta, mesh.shape, grad_axes if grad else ())
    priced = [(steps, step_seconds(steps, mesh, profile, grad, deferred, bucket_bytes)) for steps in options]
    return min(priced, key=lambda option: sum(_split(*option[1])))


def edge_times_s(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=(),
                 deferred: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[float, float]:
    """``(exposed, gradient)`` seconds to turn ``src`` into ``dst``; ``(inf, 0)`` if impossible."""
    return edge_cost(src, dst, meta, mesh, profile, training, requires_grad, grad_axes, deferred, bucket_bytes)[:2]


def edge_cost(src, dst, meta, mesh, profile, training: bool, requires_grad: bool, grad_axes=(),
              deferred: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple:
    """`edge_times_s`; whether the redistribution all-gathers (the tensor its use gets is a new buffer); the
    seconds of its forward steps, which backward runs again to gather it anew (`autotp.solve.regather`); and
    ``(step, forward seconds)`` when it is a single collective (`autotp.cost.collective_matmul`), else None.

    Worked out once per profile for tensors that get the same steps (`autotp.redistribute.options_key`): a
    costing of Llama-2-70B asks 15,000 times for some 8,500 distinct ones (``Profile.redistributions``)."""
    grad = training and requires_grad
    key = (options_key(src, dst, meta, mesh.shape, grad_axes if grad else ()), mesh, grad, deferred, bucket_bytes)
    cost = profile.redistributions.get(key)
    if cost is None:
        cost = profile.redistributions[key] = _edge_cost(src, dst, meta, mesh, profile, grad, grad_axes, deferred,
                                                         bucket_bytes)
    return cost


def _edge_cost(src, dst, meta, mesh, profile, grad: bool, grad_axes, deferred: bool, bucket_bytes: int) -> tuple:
    """`edge_cost`, worked out."""
    try:
        steps, (forward, backward, bucketed) = _cheapest(src, dst, meta, mesh, profile, grad, grad_axes, deferred,
                                                         bucket_bytes)
    except Unsupported:
        return math.inf, 0.0, False, 0.0, None
    gathered = gathers(steps, mesh.shape)
    lone = None if bucketed else lone_collective(steps, forward, backward, mesh.shape)
    return (*_split(forward, backward, bucketed), gathered, sum(forward) if gathered else 0.0, lone)
