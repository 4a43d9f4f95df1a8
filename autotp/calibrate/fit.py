"""Fit measured collective times to the profile's model: a latency plus a bandwidth curve.

``t(B) = latency + factor * B / busbw(B)``. The latency is the smallest time
measured for that link class (the smallest messages are latency-bound); each
measured size then gives one curve point ``busbw(B) = factor * B / (t(B) - latency)``,
so the model reproduces every measured point, and log-linear interpolation
covers the sizes between. A point whose time is within noise of the latency
gets the bandwidth of its larger neighbour rather than a huge or negative one.
"""

from __future__ import annotations

from autotp.cost.comm import bus_factor

_MIN_EXCESS = 0.05  # a point must exceed the latency by 5% to say anything about bandwidth


def fit_latency_s(times_by_collective: dict[str, list[tuple[int, float]]]) -> float:
    return min(t for points in times_by_collective.values() for _, t in points)


def fit_curve(points: list[tuple[int, float]], kind: str, n: int, latency_s: float) -> list[list[float]]:
    """``[(bytes, seconds)]`` -> ``[[bytes, busbw]]`` ascending, every bandwidth positive."""
    factor = bus_factor(kind, n)
    curve = []
    for nbytes, seconds in sorted(points):
        excess = seconds - latency_s
        curve.append([float(nbytes), factor * nbytes / excess if excess > _MIN_EXCESS * seconds else None])
    known = [bw for _, bw in curve if bw is not None]
    fill = known[0] if known else factor * curve[-1][0] / max(curve[-1][0], 1.0)
    for point in curve:  # latency-bound small sizes take the first measured bandwidth
        if point[1] is None:
            point[1] = fill
        else:
            fill = point[1]
    return curve


def fit_link(times_by_collective: dict[str, list[tuple[int, float]]], n: int, source: str) -> dict:
    """One link class of a profile from its measured times per collective."""
    latency = fit_latency_s(times_by_collective)
    return {"latency_s": latency,
            "busbw_Bps": {kind: fit_curve(points, kind, n, latency) for kind, points in times_by_collective.items()},
            "source": source}
