"""layer_norm, softmax and log_softmax: split any dim the op does not normalise over."""

from __future__ import annotations

from autotp.strategies.base import AxisOption, R, Shard


def layer_norm_rule(op):
    """``layer_norm(x, normalized_shape, w, b)``: split leading dims of x; w and b stay R."""
    x = op.in_metas[0]
    n_norm = len(op.args[1])
    rest = (R,) * (len(op.inputs) - 1)
    return [AxisOption(Shard(d), (Shard(d),) + rest) for d in range(len(x.shape) - n_norm) if x.shape[d] > 1]


def softmax_rule(op):
    x = op.in_metas[0]
    dim = op.args[1] % len(x.shape)
    return [AxisOption(Shard(d), (Shard(d),)) for d in range(len(x.shape)) if d != dim and x.shape[d] > 1]
