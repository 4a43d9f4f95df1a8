"""Enumerate every node's strategies on a mesh, and record the ops that fall back to R."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autotp.graph.opgraph import KIND_BUFFER, KIND_OP, KIND_PARAM, OpGraph
from autotp.graph.signature import op_signature
from autotp.strategies.base import AxisOption, Strategy, expand
from autotp.strategies.inplace import writes_in_place
from autotp.placement import Partial, R, Shard


@dataclass
class OpStrategies:
    """Strategies per node name, and why ops fell back."""

    by_node: dict[str, list[Strategy]]
    fallback: dict[str, str] = field(default_factory=dict)


def _param_options(op) -> list[AxisOption]:
    meta = op.out[0]
    return [AxisOption(Shard(d), ()) for d, size in enumerate(meta.shape) if size > 1]


def enumerate_strategies(graph: OpGraph, mesh_shape, registry, optimizer_sharding: bool = False) -> OpStrategies:
    """Apply the registry's rule to every op; an op without a usable rule gets only R.

    Rules are pure functions of an op's content, so ops with the same
    `op_signature` (the same op in each of 80 identical layers) are enumerated once.
    With ``optimizer_sharding`` (training), a trained parameter also gets each
    of its layouts with its optimizer state split where it is whole
    (`optimizer_variants`), after the plain ones. A buffer written in place
    (a key/value cache) may be split as a parameter may, where the op that
    writes it can write a split (`autotp.strategies.inplace`); other buffers
    stay whole.
    """
    result = OpStrategies(by_node={})
    seen: dict[tuple, tuple[list[Strategy], str | None]] = {}
    written = {op.inputs[0] for op in graph.nodes() if writes_in_place(op) and op.inputs}
    for op in graph.nodes():
        state = op.kind == KIND_BUFFER and op.name in written
        key = op_signature(op), state
        if key not in seen:
            strategies, reason = _strategies_of(op, mesh_shape, registry, state)
            if optimizer_sharding and op.kind == KIND_PARAM and op.requires_grad:
                strategies = strategies + [v for s in strategies for v in optimizer_variants(s, mesh_shape)]
            seen[key] = strategies, reason
        strategies, reason = seen[key]
        result.by_node[op.name] = list(strategies)
        if reason:
            result.fallback[op.name] = reason
    return result


def optimizer_variants(strategy: Strategy, mesh_shape) -> list[Strategy]:
    """``strategy`` with its optimizer state split on each axis where the parameter is whole: ZeRO-1 and 2.

    One split per such axis of size > 1, and one over all of them when the
    parameter is whole on every axis of size > 1 (the whole mesh is one group):

        mesh 2x4, layout (R, S(0)) -> optimizer state split on axis 0
        mesh 2x4, layout (R, R)    -> on axis 0, on axis 1, on both

    Each split comes twice: the gradient whole (ZeRO-1) and the gradient
    reduce-scattered into the slice (ZeRO-2). The second is the cheaper in
    time and memory wherever it can be, but it can be only where the
    gradient is summed over every axis of the split (`autotp.solve.problem.split_gradient_axes`).
    """
    whole = tuple(a for a, p in enumerate(strategy.out) if p == R and mesh_shape[a] > 1)
    axes = [(a,) for a in whole]
    if len(whole) > 1 and len(whole) == sum(size > 1 for size in mesh_shape):
        axes.append(whole)
    return [replace(strategy, optimizer_axes=a, gradient_split=g) for g in (False, True) for a in axes]


def _strategies_of(op, mesh_shape, registry, state: bool = False) -> tuple[list[Strategy], str | None]:
    """``(strategies, reason it fell back or None)`` for one op; ``state``: a buffer written in place."""
    if op.kind == KIND_PARAM or state:
        return expand(op, _param_options(op), mesh_shape), None
    if op.kind != KIND_OP:
        return expand(op, [], mesh_shape), None
    entry = registry.get(op.target)
    if entry is None:
        return expand(op, [], mesh_shape), f"no strategy rule for {op.op_name}"
    try:
        options, reason = entry.fn(op), None
    except Exception as exc:  # noqa: BLE001 - a rule that cannot handle an op replicates it
        options, reason = [], f"rule for {op.op_name} failed on these shapes ({type(exc).__name__}: {exc})"
    return expand(op, options, mesh_shape), reason


def replicated_strategy(op, mesh_ndim: int) -> Strategy:
    return Strategy(out=(R,) * mesh_ndim, ins=tuple((R,) * mesh_ndim for _ in op.inputs))


def prune_unreachable(graph: OpGraph, strategies: OpStrategies) -> None:
    """Drop strategies that need a partial sum (P) from a producer that can never make one.

    Walks in topological order, so the check is transitive: a bias add cannot
    be P (its bias is a parameter), so a residual add that would need it as P is
    dropped too. Without this, identical layers sharing a choice could be tied
    to choices the ILP cannot satisfy.
    """
    # per op, once pruned: the mesh axes some strategy leaves its output P on
    partial_axes: dict[str, frozenset[int]] = {}
    # what is looked up by the ids of strategy objects: ``needs`` per object (twin ops share them), and each op's
    # pruning by its options' objects and its inputs' partial axes (the same op in each of 80 layers is pruned
    # once); ``pruned`` holds every such list of options, so no id is reused by another object during the walk
    needs: dict[int, tuple] = {}
    pruned: dict[tuple, tuple[list, frozenset[int], list]] = {}
    for op in graph.nodes():
        options = strategies.by_node[op.name]
        key = tuple(map(id, options)), tuple(partial_axes[name] for name in op.inputs)
        if key not in pruned:
            kept = [s for s in options if all(axis in partial_axes[op.inputs[i]] for i, axis in _needs(s, needs))]
            kept = kept or [replicated_strategy(op, len(options[0].out))]
            axes = frozenset(axis for s in kept for axis, p in enumerate(s.out) if isinstance(p, Partial))
            pruned[key] = kept, axes, options
        kept, partial_axes[op.name], _ = pruned[key]
        strategies.by_node[op.name] = list(kept)


def _needs(strategy: Strategy, needs: dict[int, tuple]) -> tuple:
    """``(input, mesh axis)`` of each partial sum ``strategy`` takes, looked up once per strategy object."""
    found = needs.get(id(strategy))
    if found is None:
        found = needs[id(strategy)] = tuple((i, axis) for i, layout in enumerate(strategy.ins)
                                            for axis, p in enumerate(layout) if isinstance(p, Partial))
    return found
