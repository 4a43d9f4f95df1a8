"""Restrict the strategies the ILP may pick: pinned parameters and whole-plan styles.

Pins let a user (or a test, or a baseline) fix a parameter's placement and let
the ILP choose the rest; a style filter keeps, for every op, only strategies of
one kind, which is how the all-replicated and data-parallel baselines are built.
"""

from __future__ import annotations

from autotp.errors import PlanError
from autotp.graph.opgraph import KIND_PARAM
from autotp.placement import Partial, Replicate, Shard, layout_str, parse_layout


def replicated_only(op, strategy) -> bool:
    """Every tensor whole on every device: the single-device program on each rank."""
    return strategy.is_replicated


def data_parallel_only(op, strategy) -> bool:
    """Parameters whole; activations split on dim 0 (the batch) or partial sums of a split batch."""
    if op.kind == KIND_PARAM:
        return strategy.is_replicated
    layouts = (strategy.out,) + tuple(strategy.ins)
    return all(isinstance(p, (Replicate, Partial)) or (isinstance(p, Shard) and p.dim == 0)
               for layout in layouts for p in layout)


def apply_constraints(graph, strategies, pin: dict | None, allow) -> None:
    """Filter ``strategies.by_node`` in place; errors name the parameter and what it could be."""
    fqn_to_node = {op.fqn: op.name for op in graph.nodes() if op.kind == KIND_PARAM}
    for fqn, placements in (pin or {}).items():
        if fqn not in fqn_to_node:
            raise PlanError(f"pinned parameter {fqn!r} is not in the model; parameters are e.g. "
                            f"{', '.join(list(fqn_to_node)[:5])}")
        want = parse_layout(placements if not isinstance(placements, str) else (placements,))
        node = fqn_to_node[fqn]
        kept = [s for s in strategies.by_node[node] if s.out == want]
        if not kept:
            options = sorted({" ".join(layout_str(s.out)) for s in strategies.by_node[node]})
            raise PlanError(f"pinned placement {layout_str(want)} of {fqn!r} is not possible on this mesh "
                            f"(shape {list(graph.node(node).out[0].shape)}); possible: {options}")
        strategies.by_node[node] = kept
    if allow is None:
        return
    for op in graph.nodes():
        kept = [s for s in strategies.by_node[op.name] if allow(op, s)]
        strategies.by_node[op.name] = kept or [s for s in strategies.by_node[op.name] if s.is_replicated]
