"""Pointwise ops with broadcasting, activations, dropout and dtype casts.

Every output dim may be split; each input follows on its matching dim (aligned
from the right, as broadcasting aligns them) or stays R where it broadcasts.
Ops that are linear in an input also pass a partial sum through:
``add(P, P) -> P``, ``mul(P, R) -> P``, ``neg(P) -> P``.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, shard_or_r


def broadcast_options(op) -> list[AxisOption]:
    """Split each output dim; inputs follow where they have that dim, else stay R."""
    out = op.out[0]
    options = []
    for dim in range(len(out.shape)):
        if out.shape[dim] == 1:
            continue
        ins = tuple(shard_or_r(m, dim - (len(out.shape) - len(m.shape))) for m in op.in_metas)
        options.append(AxisOption(shard_or_r(out, dim), ins))
    return options


def _partial_all(op) -> list[AxisOption]:
    return [AxisOption(P, (P,) * len(op.inputs))]


def _partial_first(op) -> list[AxisOption]:
    return [AxisOption(P, (P,) + (R,) * (len(op.inputs) - 1))]


def _partial_either(op) -> list[AxisOption]:
    n = len(op.inputs)
    return [AxisOption(P, tuple(P if j == i else R for j in range(n))) for i in range(n)]


def unary_rule(op):
    """Nonlinear elementwise ops (gelu, exp, dropout...): split any dim, never partial."""
    return broadcast_options(op)


def linear_unary_rule(op):
    """Elementwise ops linear in their input (neg, clone, casts): split any dim, or pass P."""
    return broadcast_options(op) + (_partial_all(op) if len(op.inputs) == 1 else [])


def add_rule(op):
    """add/sub: a sum of partial sums is a partial sum, when both operands are tensors."""
    # add(P, 2.0) is not offered: the constant would be added once per device.
    return broadcast_options(op) + (_partial_all(op) if len(op.inputs) == 2 else [])


def mul_rule(op):
    """mul: linear in each operand separately, so one operand may be P with the other R."""
    return broadcast_options(op) + (_partial_either(op) if len(op.inputs) == 2 else _partial_first(op))


def div_rule(op):
    """div: linear in the numerator only, and not at all when rounded (``rounding_mode`` floor or trunc:
    ``floor(a / c) + floor(b / c)`` is not ``floor((a + b) / c)``)."""
    if op.kwargs.get("rounding_mode") is not None:
        return broadcast_options(op)
    return broadcast_options(op) + _partial_first(op)

