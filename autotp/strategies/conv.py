"""conv2d: split the batch (data parallel) or the output channels (weight and bias split on dim 0).

Input-channel splits would leave a partial sum with the bias added on every
device, so they are not offered; grouped convolutions only split the batch.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, R, Shard


def conv_rule(op):
    x, w = op.in_metas[0], op.in_metas[1]
    n_rest = len(op.inputs) - 2  # an optional bias
    options = []
    if x.shape[0] > 1:
        options.append(AxisOption(Shard(0), (Shard(0), R) + (R,) * n_rest))
    groups = op.args[6] if len(op.args) > 6 else op.kwargs.get("groups", 1)
    if groups == 1 and w.shape[0] > 1:
        options.append(AxisOption(Shard(1), (R, Shard(0)) + (Shard(0),) * n_rest))
    return options
