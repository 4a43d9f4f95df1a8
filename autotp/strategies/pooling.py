"""Pooling (max, average, adaptive average): split any dim before the pooled window dims.

``max_pool2d`` works on the last two dims of ``[N, C, H, W]`` (or ``[C, H, W]``)
one plane at a time, so the batch and the channels split freely, and the
indices ``max_pool2d_with_indices`` returns count within a plane, so they stay
valid on every shard. The pooled dims themselves are never split: a window
would straddle two devices.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, Shard


def pool_rule(spatial_dims: int):
    """The rule of a pooling op over the last ``spatial_dims`` dims."""

    def rule(op):
        x = op.in_metas[0]
        return [AxisOption(Shard(d), (Shard(d),)) for d in range(len(x.shape) - spatial_dims) if x.shape[d] > 1]

    rule.__name__ = f"pool{spatial_dims}d_rule"
    return rule
