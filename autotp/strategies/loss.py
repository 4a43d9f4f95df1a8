"""cross_entropy_loss: split the batch of rows when the reduction allows it.

``reduction='none'`` keeps one loss per row, so rows split cleanly; ``'sum'``
leaves a partial sum. ``'mean'`` (the default) divides by the count of rows that
are not ignored, which differs per device, so it is computed replicated.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard

_NONE, _MEAN, _SUM = 0, 1, 2


def cross_entropy_rule(op):
    reduction = op.args[3] if len(op.args) > 3 else op.kwargs.get("reduction", _MEAN)
    x = op.in_metas[0]
    if len(x.shape) < 2 or x.shape[0] == 1 or reduction == _MEAN:
        return []
    out = Shard(0) if reduction == _NONE else P
    # inputs: logits, target, then an optional class-weight vector that stays whole
    rest = (Shard(0),) + (R,) * (len(op.inputs) - 2)
    return [AxisOption(out, (Shard(0),) + rest)]
