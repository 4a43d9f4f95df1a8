"""Collective time on one mesh axis: ``t = latency + factor * bytes / busbw(collective, bytes)``.

``factor`` is 2(n-1)/n for an all-reduce and (n-1)/n for the others, as in
nccl-tests, so ``busbw`` is comparable across collectives and axis sizes.
"""

from __future__ import annotations

from autotp.redistribute import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SLICE


def bus_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n


def collective_time_s(kind: str, axis: int, message_bytes: float, mesh, profile) -> float:
    """Seconds for one collective of ``message_bytes`` on mesh axis ``axis``; 0 for a local slice."""
    n = mesh.shape[axis]
    if kind == SLICE or n == 1 or message_bytes == 0:
        return 0.0
    curve = profile.link(mesh.links[axis])
    return curve.latency_s + bus_factor(kind, n) * message_bytes / curve.busbw(kind, message_bytes)


__all__ = ["collective_time_s", "bus_factor", "ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER"]


def inner_time_s(op, strategy, mesh, profile) -> float:
    """All-reduces run inside a strategy's own implementation: one fp32 value per local row each."""
    total = 0.0
    for axis, calls in enumerate(strategy.inner_all_reduces):
        if calls:
            rows = op.in_metas[0].shape[0] // _row_split(strategy.ins[0], mesh.shape)
            total += calls * collective_time_s(ALL_REDUCE, axis, rows * 4, mesh, profile)
    return total


def _row_split(layout, mesh_shape) -> int:
    n = 1
    for p, size in zip(layout, mesh_shape):
        if getattr(p, "dim", None) == 0:
            n *= size
    return n
