"""Collective time on one mesh axis: ``t = latency + factor * bytes / busbw(collective, bytes)``.

``factor`` is 2(n-1)/n for an all-reduce and (n-1)/n for the others, as in
nccl-tests, so ``busbw`` is comparable across collectives and axis sizes.
"""

from __future__ import annotations

from autotp.placement import shard_factor
from autotp.redistribute import ALL_REDUCE, SLICE


def bus_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n


def collective_time_s(kind: str, axis: int, message_bytes: float, mesh, profile) -> float:
    """Seconds for one collective of ``message_bytes`` on mesh axis ``axis``; 0 for a local slice."""
    n = mesh.shape[axis]
    if kind == SLICE or n == 1 or message_bytes == 0:
        return 0.0
    curve = profile.link(mesh.links[axis])
    return curve.latency_s + bus_factor(kind, n) * message_bytes / curve.busbw(kind, message_bytes)


def inner_all_reduces(op, strategy, mesh) -> list[tuple[int, int]]:
    """``(axis, message_bytes)`` of each all-reduce a strategy's own implementation runs.

    The vocabulary-parallel loss reduces one fp32 value per local row, three times.
    """
    if not any(strategy.inner_all_reduces):
        return []
    rows = op.in_metas[0].shape[0] // shard_factor(strategy.ins[0], 0, mesh.shape)
    return [(axis, rows * 4) for axis, calls in enumerate(strategy.inner_all_reduces)
            if mesh.shape[axis] > 1 for _ in range(calls)]


def inner_time_s(op, strategy, mesh, profile) -> float:
    """Seconds of the all-reduces run inside a strategy's own implementation."""
    return sum(collective_time_s(ALL_REDUCE, axis, nbytes, mesh, profile)
               for axis, nbytes in inner_all_reduces(op, strategy, mesh))
