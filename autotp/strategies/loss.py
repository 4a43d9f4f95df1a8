"""cross_entropy_loss: split the batch of rows when the reduction allows it.

``reduction='none'`` keeps one loss per row, so rows split cleanly; ``'sum'``
leaves a partial sum. ``'mean'`` (the default) divides by the count of rows that
are not ignored, which differs per device, so rows are not split for it.

The class dim may be split too (vocabulary-parallel loss, as in Megatron): each
device reduces its slice of the logits, and three all-reduces of one number per
row (the max, the sum of exponentials, the target's logit) give the exact loss
without gathering the logits.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard
from autotp.strategies.embedding import VOCAB_PARALLEL

_NONE, _MEAN, _SUM = 0, 1, 2


def cross_entropy_rule(op):
    reduction = _arg(op, 3, "reduction", _MEAN)
    x = op.in_metas[0]
    options = []
    if len(x.shape) == 2 and len(op.inputs) == 2 and _arg(op, 5, "label_smoothing", 0.0) == 0.0:
        options.append(AxisOption(R, (Shard(1), R), impl=VOCAB_PARALLEL, inner_all_reduces=3))
    if len(x.shape) < 2 or x.shape[0] == 1 or reduction == _MEAN:
        return options
    out = Shard(0) if reduction == _NONE else P
    # inputs: logits, target, then an optional class-weight vector that stays whole
    rest = (Shard(0),) + (R,) * (len(op.inputs) - 2)
    return options + [AxisOption(out, (Shard(0),) + rest)]


def _arg(op, index: int, name: str, default):
    return op.args[index] if len(op.args) > index else op.kwargs.get(name, default)
