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
