"""embedding: split the table's hidden dim, its vocabulary, or the batch of indices.

The vocabulary split (Megatron's vocab-parallel embedding) looks up only the
rows this device holds and zeroes the others, so the output is a partial sum.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard


def embedding_rule(op):
    weight, idx = op.in_metas[0], op.in_metas[1]
    out_nd = len(op.out[0].shape)
    options = [AxisOption(Shard(d), (R, Shard(d))) for d in range(len(idx.shape)) if idx.shape[d] > 1]
    if weight.shape[1] > 1:
        options.append(AxisOption(Shard(out_nd - 1), (Shard(1), R)))
    if len(op.args) <= 2 or op.args[2] in (-1, None):  # no padding_idx
        options.append(AxisOption(P, (Shard(0), R), impl=VOCAB_PARALLEL))
    return options


VOCAB_PARALLEL = "vocab_parallel"
