"""embedding: split the hidden dim of the table (column split) or the batch of indices."""

from __future__ import annotations

from autotp.strategies.base import AxisOption, R, Shard


def embedding_rule(op):
    weight, idx = op.in_metas[0], op.in_metas[1]
    out_nd = len(op.out[0].shape)
    options = [AxisOption(Shard(d), (R, Shard(d))) for d in range(len(idx.shape)) if idx.shape[d] > 1]
    if weight.shape[1] > 1:
        options.append(AxisOption(Shard(out_nd - 1), (Shard(1), R)))
    return options
