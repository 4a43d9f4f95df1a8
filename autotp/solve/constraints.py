"""Restrict the strategies the ILP may pick: pinned parameters (and buffers) and whole-plan styles.

Pins let a user (or a test, or a baseline) fix a parameter's placement and let
the ILP choose the rest; a style filter keeps, for every op, only strategies of
one kind, which is how the all-replicated and data-parallel baselines are built.
"""

from __future__ import annotations

from autotp.errors import PlanError
from autotp.graph.opgraph import KIND_BUFFER, KIND_PARAM
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
    """Filter ``strategies.by_node`` in place; errors name the parameter and what it could be.

    An op that ``allow`` leaves with no strategy is replicated, unless the
    filter is marked ``strict`` (as `same_as` is): then that is an error.
    """
    fqn_to_node = {op.fqn: op.name for op in graph.nodes() if op.kind in (KIND_PARAM, KIND_BUFFER)}
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
        if not kept and getattr(allow, "strict", False):
            raise PlanError(f"op {op.name} ({op.op_name}) has no strategy the filter accepts at these shapes "
                            f"({', '.join(str(m) for m in op.in_metas)}): give the smaller model inputs of the "
                            "same rank and sizes the mesh divides")
        strategies.by_node[op.name] = kept or [s for s in strategies.by_node[op.name] if s.is_replicated]


def same_as(plan):
    """A filter that keeps, for every op, exactly the strategy ``plan`` chose for the node of that name.

    Replays a plan made at one size (say, on the meta device at full scale) on
    a smaller model of the same architecture, so a CPU run checks the very
    program the large plan describes, not merely the same parameter placements.
    Ops the plan does not name keep all their strategies.
    """

    def allow(op, strategy) -> bool:
        entry = plan.nodes.get(op.name)
        if entry is None or entry.op != op.op_name:
            return True
        split = tuple(plan.optimizer_sharding.get(op.fqn, ())) if op.kind == KIND_PARAM else ()
        return (layout_str(strategy.out) == tuple(entry.out) and strategy.impl == entry.impl
                and tuple(layout_str(layout) for layout in strategy.ins) == tuple(tuple(i) for i in entry.ins)
                and tuple(plan.mesh.names[a] for a in strategy.optimizer_axes) == split
                and strategy.gradient_split == (op.fqn in plan.gradient_sharding if op.kind == KIND_PARAM else False))

    allow.strict = True  # an op with no matching strategy is an error, not a silent replicate
    return allow
