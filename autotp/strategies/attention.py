"""scaled_dot_product_attention: split the batch or the heads, never the sequence.

``q: [b, h, s, d]``, ``k, v: [b, h, t, d]``. Splitting heads is tensor parallel
attention; splitting the batch is data parallel. The sequence is not offered:
``is_causal`` assumes each device holds the whole query range.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, shard_or_r
from autotp.placement import Shard


def sdpa_rule(op):
    q, k = op.in_metas[0], op.in_metas[1]
    options = []
    for dim in (0, 1):
        if q.shape[dim] == 1 or k.shape[dim] != q.shape[dim]:
            continue  # grouped-query attention with fewer K/V heads is not split here yet
        ins = tuple(_mask_place(m, dim, i) for i, m in enumerate(op.in_metas))
        options.append(AxisOption(Shard(dim), ins))
    return options


def _mask_place(meta, dim: int, index: int):
    if index < 3:
        return Shard(dim)
    offset = 4 - len(meta.shape)  # an attention mask broadcasts from the right
    return shard_or_r(meta, dim - offset)
