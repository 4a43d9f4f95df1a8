"""Collective time on one mesh axis: ``t = latency + factor * bytes / busbw(collective, bytes)``.

``factor`` is 2(n-1)/n for an all-reduce and (n-1)/n for the others, as in
nccl-tests, so ``busbw`` is comparable across collectives and axis sizes.
A flat collective over several axes at once is bounded by its slowest link
(`span_time_s`). A parameter's gradient sum runs inside a DDP-style bucket
(`bucketed_step_time_s`): it pays its share of the bucket's one latency and
moves its bytes at the bucket's bandwidth.
"""

from __future__ import annotations

import math

from autotp.capture.experts import EXPERTS
from autotp.placement import local_bytes, shard_factor
from autotp.redistribute import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SLICE
from autotp.strategies.experts import routed_axes, routed_bytes

ALL_TO_ALL = "all_to_all"

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb=25


def bus_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n


def _span_time_s(kind: str, axes, message_bytes: float, mesh, profile, latency_share: float = 1.0,
                 bandwidth_at: float | None = None) -> float:
    """Seconds of one collective over the devices of ``axes``: the slowest link's latency and bandwidth.

    ``latency_share`` of the latency is paid; the bus bandwidth is read at
    ``bandwidth_at`` bytes (the message itself by default). Each is worked
    out once per profile (``Profile.spans``).
    """
    key = (kind, tuple(axes), message_bytes, mesh, latency_share, bandwidth_at)
    seconds = profile.spans.get(key)
    if seconds is None:
        seconds = profile.spans[key] = _span_seconds(kind, axes, message_bytes, mesh, profile, latency_share,
                                                     bandwidth_at)
    return seconds


def _span_seconds(kind: str, axes, message_bytes: float, mesh, profile, latency_share: float,
                  bandwidth_at: float | None) -> float:
    """`_span_time_s`, worked out."""
    n = math.prod(mesh.shape[a] for a in axes)
    if kind == SLICE or n == 1 or message_bytes == 0:
        return 0.0
    curves = [profile.link(mesh.links[a]) for a in axes]
    size = message_bytes if bandwidth_at is None else bandwidth_at
    busbw = min(c.busbw(kind, size) for c in curves)
    return latency_share * max(c.latency_s for c in curves) + bus_factor(kind, n) * message_bytes / busbw


def collective_time_s(kind: str, axis: int, message_bytes: float, mesh, profile) -> float:
    """Seconds for one collective of ``message_bytes`` on mesh axis ``axis``; 0 for a local slice."""
    return _span_time_s(kind, (axis,), message_bytes, mesh, profile)


def span_time_s(kind: str, axes, message_bytes: float, mesh, profile) -> float:
    """Seconds for one collective over the devices of several mesh axes at once (a flat ring).

    The ring crosses every axis's link, so the slowest link bounds it: the
    largest latency and the smallest bus bandwidth among those links at this
    message size, with the factor of all ``prod(sizes)`` devices. One axis
    gives exactly `collective_time_s`.
    """
    return _span_time_s(kind, axes, message_bytes, mesh, profile)


def step_time_s(kind: str, step, mesh, profile) -> float:
    """Seconds for ``kind`` (a step's forward or backward collective) on the devices the step spans."""
    return _span_time_s(kind, step.span, step.message_bytes, mesh, profile)


def bucketed_step_time_s(kind: str, step, gradient_bytes: int, mesh, profile, bucket_bytes: int) -> float:
    """Seconds of ``step`` of a gradient sum of ``gradient_bytes`` run inside buckets of ``bucket_bytes``.

    A bucket launches one collective per step for all its members, so a
    gradient smaller than the bucket pays ``gradient_bytes / bucket_bytes`` of
    the latency, and its bytes move at the bandwidth of the bucket's message
    (this step's message scaled by the same ratio). A gradient larger than the
    bucket is a bucket of its own. Linear in the bytes: the ILP can add it up.

        25 MiB buckets, a 1 MiB norm gradient: 1/25 of the latency, bandwidth at 25 MiB
    """
    return bucketed_time_s(kind, step.span, step.message_bytes, gradient_bytes, mesh, profile, bucket_bytes)


def bucketed_time_s(kind: str, axes, message_bytes: int, gradient_bytes: int, mesh, profile,
                    bucket_bytes: int) -> float:
    """`bucketed_step_time_s` of a collective of ``message_bytes`` over the devices of ``axes``."""
    scale = max(1.0, bucket_bytes / gradient_bytes) if gradient_bytes else 1.0
    return _span_time_s(kind, axes, message_bytes, mesh, profile, latency_share=1.0 / scale,
                        bandwidth_at=message_bytes * scale)


def gradient_slice_time_s(axes, gradient_bytes: int, mesh, profile, bucket_bytes: int) -> float:
    """Seconds of ZeRO-2's reduce-scatter of a whole gradient into the optimizer slices over ``axes``, in buckets."""
    return bucketed_time_s(REDUCE_SCATTER, axes, gradient_bytes, gradient_bytes, mesh, profile, bucket_bytes)


def inner_collective_calls(op, strategy, mesh, training: bool) -> list[tuple[str, int, int, str]]:
    """``(kind, axis, message_bytes, phase)`` of each collective a strategy's own implementation runs.

    The vocabulary-parallel loss all-reduces one fp32 value per local row,
    three times; the batch-split mean loss two values once (the sum and the
    count). Expert parallelism sends each routed (token, expert) pair's hidden
    vector to its expert's owner and back by all-to-all on each routing axis,
    forward and again in backward (`autotp.strategies.experts`).
    """
    calls = []
    if any(strategy.inner_all_reduces):
        values = strategy.inner_values or op.in_metas[0].shape[0] // shard_factor(strategy.ins[0], 0, mesh.shape)
        calls += [(ALL_REDUCE, axis, values * 4, "forward") for axis, n in enumerate(strategy.inner_all_reduces)
                  if mesh.shape[axis] > 1 for _ in range(n)]
    if op.target == EXPERTS:
        axes = [a for a in routed_axes(strategy) if mesh.shape[a] > 1]
        nbytes = routed_bytes(op, strategy, mesh.shape)
        phases = ("forward", "backward") if training and op.requires_grad else ("forward",)
        calls += [(ALL_TO_ALL, a, nbytes, phase) for phase in phases for a in axes for _ in range(2)]
    return calls


def inner_time_s(op, strategy, mesh, profile, training: bool) -> float:
    """Seconds of the collectives run inside a strategy's own implementation."""
    return sum(collective_time_s(kind, axis, nbytes, mesh, profile)
               for kind, axis, nbytes, _ in inner_collective_calls(op, strategy, mesh, training))


def optimizer_gather(op, strategy, mesh) -> tuple[tuple, int] | None:
    """``(axes, message_bytes)`` of the all-gather that rebuilds a parameter after a ZeRO-1 step, or None.

    Each device steps its slice of the parameter (`Strategy.optimizer_axes`),
    then one all-gather over those axes gives every device the whole of it
    again, in the parameter's dtype.
    """
    if not strategy.optimizer_axes:
        return None
    return strategy.optimizer_axes, local_bytes(op.out[0], strategy.out, mesh.shape)


def optimizer_time_s(op, strategy, mesh, profile) -> float:
    """Seconds of `optimizer_gather`, exposed: it runs between the optimizer step and the next forward."""
    gather = optimizer_gather(op, strategy, mesh)
    return span_time_s(ALL_GATHER, gather[0], gather[1], mesh, profile) if gather else 0.0
