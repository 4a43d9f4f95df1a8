"""In-place updates that capture leaves in place: of graph inputs and buffers (running statistics).

Capture rewrites in-place ops on activations out of place
(`autotp.capture.normalize.functionalize_inplace`), so the in-place ops
left in a graph write into a tensor the caller or the module owns: a user
input, or a buffer such as BatchNorm's ``running_mean`` and
``num_batches_tracked``, or a key/value cache. The update must reach that
very tensor, not a slice or a gathered copy of it, so the written input is
taken as its producer lays it out, never redistributed (`writes_in_place`,
which `autotp.solve.problem` enforces). Most of these ops offer no split:
they run whole on every rank, and every rank's buffer takes the same update
as the single-device model's. A cache's write (``index_copy_`` along the
positions) splits on any other dim, its kv-heads above all: each device then
keeps and writes only its heads' keys and values, on a buffer that is split
alike (`autotp.strategies.enumerate` offers splits to buffers written in place).
"""

from __future__ import annotations

from autotp.graph.opgraph import KIND_OP
from autotp.placement import R, Shard
from autotp.strategies.base import AxisOption

INPLACE_UPDATES = ("copy_", "add_", "sub_", "mul_", "div_", "fill_", "zero_", "clamp_", "masked_fill_", "relu_",
                   "gelu_", "silu_", "sigmoid_", "tanh_", "exp_", "neg_", "pow_", "sqrt_", "abs_", "lerp_",
                   "addcmul_", "addcdiv_", "index_put_", "index_add_", "scatter_", "scatter_add_", "clamp_min_",
                   "clamp_max_", "fill_diagonal_", "index_copy_")  # the last: a key/value cache's write


def writes_in_place(op) -> bool:
    """Whether ``op`` updates its first input in place: that input is taken as it is laid out."""
    packet = getattr(op.target, "overloadpacket", None) if op.kind == KIND_OP else None
    return packet is not None and packet.__name__ in INPLACE_UPDATES


def in_place_update_rule(op):
    """Only the replicated strategy (which `expand` always adds): see the module docstring."""
    return []


def index_copy_rule(op):
    """``self.index_copy_(dim, index, source)``: split on any dim but ``dim``, ``self`` and ``source`` alike,
    the index whole (it names positions along ``dim``, which every device holds)."""
    meta = op.in_metas[0]
    dim = op.args[1] % len(meta.shape)
    return [AxisOption(Shard(d), (Shard(d), R, Shard(d))) for d in range(len(meta.shape))
            if d != dim and meta.shape[d] > 1]
