"""Roofline compute time of one op on its local shapes.

``max(flops / (peak[dtype] * matmul_efficiency), bytes / (hbm_bw * memory_efficiency)) + launch``,
times ``1 + backward_compute_factor`` when the op is differentiated in training.
Views cost nothing: no kernel runs. A split random op also draws its whole tensor.
A mixture of experts' work is its (token, expert) pairs, however they are split
(`autotp.strategies.experts.work_share`).
"""

from __future__ import annotations

import math

import torch

from autotp.capture.experts import EXPERTS
from autotp.graph.flops import is_alias, op_bytes, op_flops
from autotp.graph.opgraph import KIND_OP, TensorMeta
from autotp.graph.random import SDPA, draws_whole, sdpa_weights_shape
from autotp.placement import local_shape
from autotp.strategies.experts import work_share


def local_metas(metas, layouts, mesh_shape) -> list[TensorMeta]:
    return [TensorMeta(local_shape(m.shape, lay, mesh_shape), m.dtype) for m, lay in zip(metas, layouts)]


def _compute_dtype(op):
    """The dtype whose peak bounds the op; integer and bool ops are costed at the fp32 peak."""
    floats = [m.dtype for m in op.in_metas + op.out if m.is_float]
    return floats[0] if floats else torch.float32


def forward_time_s(op, strategy, mesh, profile) -> float:
    """One forward execution of ``op`` under ``strategy``, on one device."""
    if op.kind != KIND_OP or is_alias(op.target):
        return 0.0
    shape = mesh.shape
    ins = local_metas(op.in_metas, strategy.ins, shape)
    outs = local_metas(op.out, [strategy.out] * len(op.out), shape)
    dev = profile.device
    flops = op_flops(op.target, ins, outs)
    if op.target == EXPERTS:  # local shapes miscount the work of experts split over whole tokens
        flops = op_flops(op.target, op.in_metas, op.out) * work_share(strategy, shape)
    flops_s = flops / (profile.peak_flops(_compute_dtype(op)) * dev["matmul_efficiency"])
    bytes_s = (op_bytes(op.target, ins, outs) + _whole_draw_bytes(op, strategy, shape)) / (
        dev["memory_bandwidth_Bps"] * dev["memory_efficiency"])
    return max(flops_s, bytes_s) + dev["launch_overhead_s"]


def _whole_draw_bytes(op, strategy, mesh_shape) -> int:
    """The bytes a split random op writes drawing its whole tensor (`autotp.lower.random_ops`), beyond its
    piece's: the whole noise (and the ones it is drawn on), for attention the whole weights' mask."""
    if not draws_whole(op.target, op.args, op.kwargs, strategy.out, mesh_shape):
        return 0
    if op.target == SDPA:
        q, k = op.in_metas[0], op.in_metas[1]
        return 2 * math.prod(sdpa_weights_shape(q, k)) * q.dtype.itemsize
    return 2 * op.in_metas[0].nbytes


def compute_time_s(op, strategy, mesh, profile, training: bool) -> float:
    """Forward time, plus the backward's when ``training`` and the op is differentiated."""
    fwd = forward_time_s(op, strategy, mesh, profile)
    if training and op.requires_grad:
        return fwd * (1.0 + profile.device["backward_compute_factor"])
    return fwd


def backward_time_s(op, strategy, mesh, profile, training: bool) -> float:
    """The backward part of `compute_time_s`: the compute that gradient reductions can hide behind."""
    if not (training and op.requires_grad):
        return 0.0
    return forward_time_s(op, strategy, mesh, profile) * profile.device["backward_compute_factor"]
