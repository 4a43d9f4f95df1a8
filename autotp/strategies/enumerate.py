"""Enumerate every node's strategies on a mesh, and record the ops that fall back to R."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.graph.opgraph import KIND_OP, KIND_PARAM, OpGraph
from autotp.strategies.base import AxisOption, Strategy, expand
from autotp.placement import Partial, R, Shard


@dataclass
class OpStrategies:
    """Strategies per node name, which ops follow their producer, and why ops fell back."""

    by_node: dict[str, list[Strategy]]
    followers: set[str] = field(default_factory=set)
    fallback: dict[str, str] = field(default_factory=dict)


def _param_options(op) -> list[AxisOption]:
    meta = op.out[0]
    return [AxisOption(Shard(d), ()) for d, size in enumerate(meta.shape) if size > 1]


def enumerate_strategies(graph: OpGraph, mesh_shape, registry) -> OpStrategies:
    """Apply the registry's rule to every op; an op without a usable rule gets only R."""
    result = OpStrategies(by_node={})
    for op in graph.nodes():
        if op.kind == KIND_PARAM:
            result.by_node[op.name] = expand(op, _param_options(op), mesh_shape)
            continue
        if op.kind != KIND_OP:
            result.by_node[op.name] = expand(op, [], mesh_shape)
            continue
        entry = registry.get(op.target)
        options, reason = [], None
        if entry is None:
            reason = f"no strategy rule for {op.op_name}"
        else:
            try:
                options = entry.fn(op)
            except Exception as exc:  # noqa: BLE001 - a rule that cannot handle an op replicates it
                reason = f"rule for {op.op_name} failed on these shapes ({type(exc).__name__}: {exc})"
            if entry.follower:
                result.followers.add(op.name)
        result.by_node[op.name] = expand(op, options, mesh_shape)
        if reason:
            result.fallback[op.name] = reason
    return result


def replicated_strategy(op, mesh_ndim: int) -> Strategy:
    return Strategy(out=(R,) * mesh_ndim, ins=tuple((R,) * mesh_ndim for _ in op.inputs))


def prune_unreachable(graph: OpGraph, strategies: OpStrategies) -> None:
    """Drop strategies that need a partial sum (P) from a producer that can never make one.

    Walks in topological order, so the check is transitive: a bias add cannot
    be P (its bias is a parameter), so a residual add that would need it as P is
    dropped too. Without this, follower merging could tie a group to choices
    the ILP cannot satisfy.
    """
    for op in graph.nodes():
        options = strategies.by_node[op.name]
        kept = [s for s in options if _partials_reachable(s, op, strategies)]
        strategies.by_node[op.name] = kept or [replicated_strategy(op, len(options[0].out))]


def _partials_reachable(strategy: Strategy, op, strategies: OpStrategies) -> bool:
    for layout, producer in zip(strategy.ins, op.inputs):
        for axis, placement in enumerate(layout):
            if isinstance(placement, Partial) and not any(
                    isinstance(t.out[axis], Partial) for t in strategies.by_node[producer]):
                return False
    return True
