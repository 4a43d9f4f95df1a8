"""Collective time on one mesh axis: ``t = latency + factor * bytes / busbw(collective, bytes)``.

``factor`` is 2(n-1)/n for an all-reduce and (n-1)/n for the others, as in
nccl-tests, so ``busbw`` is comparable across collectives and axis sizes.
A flat collective over several axes at once is bounded by its slowest link
(`span_time_s`).
"""

from __future__ import annotations

import math

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


def span_time_s(kind: str, axes, message_bytes: float, mesh, profile) -> float:
    """Seconds for one collective over the devices of several mesh axes at once (a flat ring).

    The ring crosses every axis's link, so the slowest link bounds it: the
    largest latency and the smallest bus bandwidth among those links at this
    message size, with the factor of all ``prod(sizes)`` devices. One axis
    gives exactly `collective_time_s`.
    """
    n = math.prod(mesh.shape[a] for a in axes)
    if kind == SLICE or n == 1 or message_bytes == 0:
        return 0.0
    curves = [profile.link(mesh.links[a]) for a in axes]
    busbw = min(c.busbw(kind, message_bytes) for c in curves)
    return max(c.latency_s for c in curves) + bus_factor(kind, n) * message_bytes / busbw


def step_time_s(kind: str, step, mesh, profile) -> float:
    """Seconds for ``kind`` (a step's forward or backward collective) on the devices the step spans."""
    if len(step.span) == 1:
        return collective_time_s(kind, step.axis, step.message_bytes, mesh, profile)
    return span_time_s(kind, step.span, step.message_bytes, mesh, profile)


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
