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


class TrainingBatchNormNotSplit(Exception):
    """Raised by `batch_norm_rule` for the one form capture leaves whole; the message is the reason."""


def batch_norm_rule(op):
    """``batch_norm(x, w, b, running_mean, running_var, training, momentum, eps)``.

    In eval mode it is a per-channel affine map: any dim but the channels (dim
    1) splits with the vectors whole, and the channels split with every
    vector sliced alike (the running statistics are only read). Training mode
    normally never gets here: capture writes it out as sums
    (`autotp.capture.normalize.decompose_batch_norm`), so a batch split
    all-reduces the statistics. ``momentum=None`` stays whole here (torch.export
    cannot capture ``nn.BatchNorm`` with it, but a graph given as it is may hold it).
    """
    if op.args[5]:
        raise TrainingBatchNormNotSplit(
            "training-mode batch_norm with momentum=None (a cumulative average) runs replicated: its statistics "
            "need the whole batch")
    x = op.in_metas[0]
    rest = len(op.inputs) - 1
    options = [AxisOption(Shard(d), (Shard(d),) + (R,) * rest) for d in range(len(x.shape)) if d != 1 and x.shape[d] > 1]
    if len(x.shape) > 1 and x.shape[1] > 1:
        options.append(AxisOption(Shard(1), (Shard(1),) + (Shard(0),) * rest))
    return options
