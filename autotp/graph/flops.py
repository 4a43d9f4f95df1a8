"""FLOPs of one ATen op from its input and output shapes (forward pass only).

Matmul-like ops count a multiply-add as two FLOPs; attention counts its two
batched matmuls; everything else counts one FLOP per output element, which only
matters for the roofline's compute side of memory-bound ops.
"""

from __future__ import annotations

import math
import operator

import torch

from autotp.capture.experts import EXPERTS

aten = torch.ops.aten


def _numel(shape) -> int:
    return math.prod(shape)


def _contracted(ins, out) -> int:
    """Size of the contracted dim of a matmul: the last dim of the first input."""
    return ins[0].shape[-1] if ins and ins[0].shape else 1


ALIAS_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.numpy_T.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default, aten.detach.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.slice.Tensor,
    aten.select.int, aten.unbind.int,
})
"""Ops that return a view: no kernel runs, so they cost neither FLOPs nor memory traffic."""


def is_alias(target) -> bool:
    return target in ALIAS_OPS or target is operator.getitem


def op_bytes(target, ins, out) -> int:
    """Bytes an op reads and writes (zero for views).

    An embedding reads only the rows it gathers, not its whole table.
    """
    if is_alias(target):
        return 0
    if target == aten.embedding.default:
        return ins[1].nbytes + 2 * sum(m.nbytes for m in out)
    return sum(m.nbytes for m in ins) + sum(m.nbytes for m in out)


def op_flops(target, ins, out) -> int:
    """Forward FLOPs of ``target`` given input ``TensorMeta``s and output metas (a list)."""
    if is_alias(target):
        return 0
    out_numel = sum(_numel(o.shape) for o in out)
    if target in (aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default):
        return 2 * out_numel * _contracted(ins if target != aten.addmm.default else ins[1:], out)
    if target == aten.conv2d.default:
        w = ins[1].shape  # (C_out, C_in / groups, kh, kw)
        return 2 * out_numel * w[1] * w[2] * w[3]
    if target == aten.scaled_dot_product_attention.default:
        q, k = ins[0].shape, ins[1].shape
        return 4 * _numel(q[:-1]) * k[-2] * q[-1]
    if target == EXPERTS:  # each (token, expert) pair: gate and up (h -> 2 * inner), then down (inner -> h)
        hidden, index, gate_up = ins[0], ins[1], ins[3]
        return 3 * _numel(index.shape) * gate_up.shape[1] * hidden.shape[-1]
    return out_numel
