"""Which ops draw random numbers, and when a split one must draw its whole tensor.

Pure rules over an op's target, arguments and output layout, read by the
cost model (a whole draw costs its full size) and by the lowering
(`autotp.lower.random_ops`, which says why the whole tensor is drawn).
"""

from __future__ import annotations

import torch

from autotp.placement import Shard

aten = torch.ops.aten

# out = input * noise, the noise drawn from the input's shape alone: the op applied to ones gives the noise
MULTIPLICATIVE = frozenset({aten.dropout.default, aten.feature_dropout.default})
# the values drawn depend on the input's shape, strides and dtype, never on its values
SHAPE_ONLY = frozenset({aten.rand_like.default, aten.randn_like.default, aten.bernoulli.p})
SDPA = aten.scaled_dot_product_attention.default


def draws_whole(target, args: tuple, kwargs: dict, layout, mesh_shape) -> bool:
    """Whether this op, with this output layout, must draw its whole tensor to match the single device: a
    random op (attention with dropout included) whose output is split."""
    return draws(target, args, kwargs) and any(isinstance(p, Shard) and mesh_shape[a] > 1
                                               for a, p in enumerate(layout))


def draws(target, args: tuple, kwargs: dict) -> bool:
    """Whether the op draws random numbers: dropout in training with p > 0, attention with ``dropout_p > 0``,
    and the ``*_like`` random ops."""
    if target in MULTIPLICATIVE:
        return bool(args[2]) and float(args[1]) > 0  # (input, p, train); otherwise ATen returns the input
    return target in SHAPE_ONLY or (target == SDPA and sdpa_dropout(args, kwargs) > 0)


def sdpa_dropout(args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of a ``scaled_dot_product_attention`` call (0 when not given)."""
    return float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))


def sdpa_weights_shape(q, k) -> tuple[int, ...]:
    """The attention weights' shape ``[..., s, t]`` (the dropout mask's) from ``q [..., s, d]`` and ``k [..., t, d]``."""
    return (*q.shape[:-1], k.shape[-2])
