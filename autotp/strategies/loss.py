"""cross_entropy_loss: split the batch of rows when the reduction allows it.

``reduction='none'`` keeps one loss per row, so rows split cleanly; ``'sum'``
leaves a partial sum. ``'mean'`` (the default) divides by the count of rows that
are not ignored (or their targets' class weights), which differs per device:
rows split for it with an implementation that sums both over the devices,
one all-reduce of two numbers, and divides (``batch_mean``; data
parallelism's loss, exact however many targets each device ignores).

The class dim may be split too (vocabulary-parallel loss, as in Megatron): each
device reduces its slice of the logits, and three all-reduces of one number per
row (the max, the sum of exponentials, the target's logit) give the exact loss
without gathering the logits.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard
from autotp.strategies.embedding import VOCAB_PARALLEL

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2  # aten's codes


def cross_entropy_rule(op):
    reduction = loss_arg(op.args, op.kwargs, "reduction")
    x = op.in_metas[0]
    options = []
    if len(x.shape) == 2 and len(op.inputs) == 2 and loss_arg(op.args, op.kwargs, "label_smoothing") == 0.0:
        options.append(AxisOption(R, (Shard(1), R), impl=VOCAB_PARALLEL, inner_all_reduces=3))
    if len(x.shape) < 2 or x.shape[0] == 1:
        return options
    # inputs: logits, target, then an optional class-weight vector that stays whole
    ins = (Shard(0), Shard(0)) + (R,) * (len(op.inputs) - 2)
    if reduction == REDUCTION_MEAN:
        if loss_arg(op.args, op.kwargs, "label_smoothing") != 0.0:
            return options
        return options + [AxisOption(R, ins, impl=BATCH_MEAN, inner_all_reduces=1, inner_values=2)]
    return options + [AxisOption(Shard(0) if reduction == REDUCTION_NONE else P, ins)]


BATCH_MEAN = "batch_mean"


_ARGS = {"reduction": (3, REDUCTION_MEAN), "ignore_index": (4, -100), "label_smoothing": (5, 0.0)}


def loss_arg(args: tuple, kwargs: dict, name: str):
    """An argument of ``cross_entropy_loss(input, target, weight, reduction, ignore_index, label_smoothing)``."""
    index, default = _ARGS[name]
    return args[index] if len(args) > index else kwargs.get(name, default)
