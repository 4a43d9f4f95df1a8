"""Local implementations for strategies that are not the op itself on local shards.

All are built from autograd-aware collectives, so their backward needs no
hand-written rule. Two are Megatron-LM's vocabulary-parallel pieces, one is
data parallelism's loss:

- `VocabParallelEmbedding`: look up the rows this device holds, zero the rest;
  the result is a partial sum (``P``) the planner reduces like any other.
- `VocabParallelCrossEntropy`: the loss of logits split over classes, from
  three all-reduces of one number per row (max, sum of exponentials, target
  logit), without gathering the logits.
- `BatchMeanCrossEntropy`: the mean loss of rows split over devices: the
  sum of the losses and the count (or class weight) of the targets not
  ignored, summed over the devices in one all-reduce, then divided: the
  single device's mean, however many targets each device ignores.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.lower.collectives import all_reduce_partial
from autotp.lower.experts import build_expert_columns, build_expert_parallel
from autotp.placement import Shard, shard_factor, shard_index
from autotp.strategies.experts import EXPERT_COLUMNS, EXPERT_PARALLEL
from autotp.strategies.loss import BATCH_MEAN, REDUCTION_NONE, REDUCTION_SUM, loss_arg


def vocab_start(layout, dim: int, coords, mesh_shape, local_size: int) -> int:
    """First index along ``dim`` that this device holds under ``layout``."""
    return shard_index(layout, dim, coords, mesh_shape) * local_size


class VocabParallelEmbedding(nn.Module):
    """``embedding(weight[start:start+rows], idx)`` with rows outside this device's range zeroed."""

    def __init__(self, start: int, rows: int):
        super().__init__()
        self.start, self.rows = start, rows

    def forward(self, weight, idx):
        local = idx - self.start
        inside = (local >= 0) & (local < self.rows)
        out = torch.ops.aten.embedding.default(weight, local.clamp(0, self.rows - 1))
        return out * inside.unsqueeze(-1).to(out.dtype)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows - 1}"


class VocabParallelCrossEntropy(nn.Module):
    """Cross-entropy of ``[N, C]`` logits split over C across ``comms`` (one per splitting mesh axis)."""

    def __init__(self, start: int, cols: int, comms, reduction: int, ignore_index: int):
        super().__init__()
        self.start, self.cols, self.comms = start, cols, comms
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits, target):
        row_max = logits.detach().max(dim=1).values  # shift-invariant: no gradient flows through the max
        for comm in self.comms:
            row_max = funcol.wait_tensor(funcol.all_reduce(row_max, "max", comm.group))
        shifted = logits - row_max.unsqueeze(1)
        sum_exp = shifted.exp().sum(dim=1)
        local = target - self.start
        inside = (local >= 0) & (local < self.cols)
        picked = shifted.gather(1, local.clamp(0, self.cols - 1).unsqueeze(1)).squeeze(1) * inside.to(logits.dtype)
        for comm in self.comms:  # partial sums over the class split -> whole
            sum_exp = all_reduce_partial(sum_exp, comm)
            picked = all_reduce_partial(picked, comm)
        valid = (target != self.ignore_index).to(logits.dtype)
        loss = (sum_exp.log() - picked) * valid
        if self.reduction == REDUCTION_NONE:
            return loss
        if self.reduction == REDUCTION_SUM:
            return loss.sum()
        return loss.sum() / valid.sum()

    def extra_repr(self) -> str:
        return f"classes {self.start}..{self.start + self.cols - 1}, over {[c.name for c in self.comms]}"


class BatchMeanCrossEntropy(nn.Module):
    """Mean cross-entropy of ``[N, C]`` logits whose rows are split across ``comms``."""

    def __init__(self, comms, ignore_index: int):
        super().__init__()
        self.comms, self.ignore_index = comms, ignore_index

    def forward(self, logits, target, weight=None):
        total = torch.ops.aten.cross_entropy_loss.default(logits, target, weight, REDUCTION_SUM, self.ignore_index)
        valid = target != self.ignore_index
        counted = (weight[torch.where(valid, target, 0)] * valid if weight is not None else valid).sum().to(total.dtype)
        both = torch.stack([total, counted])
        for comm in self.comms:  # partial sums over the row split -> whole, in one all-reduce of two numbers
            both = all_reduce_partial(both, comm)
        return both[0] / both[1]

    def extra_repr(self) -> str:
        return f"rows split over {[c.name for c in self.comms]}"


def build_impl(impl: str, target, op_args: tuple, op_kwargs: dict, in_layouts, in_shapes, coords, mesh_shape,
               comms) -> nn.Module:
    """The module implementing strategy ``impl`` of op ``target`` for one node on this device."""
    if impl == BATCH_MEAN:
        axes = [a for a, p in enumerate(in_layouts[0]) if isinstance(p, Shard) and p.dim == 0 and mesh_shape[a] > 1]
        return BatchMeanCrossEntropy([comms[a] for a in axes], loss_arg(op_args, op_kwargs, "ignore_index"))
    if impl == "vocab_parallel" and target == torch.ops.aten.cross_entropy_loss.default:
        return _cross_entropy(op_args, op_kwargs, in_layouts, in_shapes, coords, mesh_shape, comms)
    if impl == "vocab_parallel" and target == torch.ops.aten.embedding.default:
        rows = in_shapes[0][0] // shard_factor(in_layouts[0], 0, mesh_shape)
        return VocabParallelEmbedding(vocab_start(in_layouts[0], 0, coords, mesh_shape, rows), rows)
    if impl == EXPERT_PARALLEL:
        return build_expert_parallel(op_args[-1], in_layouts, in_shapes, coords, mesh_shape, comms)
    if impl == EXPERT_COLUMNS:
        return build_expert_columns(op_args[-1], in_layouts, in_shapes, coords, mesh_shape)
    raise ValueError(f"no implementation {impl!r} for {target}")


def _cross_entropy(op_args, op_kwargs, in_layouts, in_shapes, coords, mesh_shape, comms) -> nn.Module:
    cols = in_shapes[0][1] // shard_factor(in_layouts[0], 1, mesh_shape)
    axes = [a for a, p in enumerate(in_layouts[0]) if isinstance(p, Shard) and p.dim == 1]
    return VocabParallelCrossEntropy(vocab_start(in_layouts[0], 1, coords, mesh_shape, cols), cols,
                                     [comms[a] for a in axes], loss_arg(op_args, op_kwargs, "reduction"),
                                     loss_arg(op_args, op_kwargs, "ignore_index"))
