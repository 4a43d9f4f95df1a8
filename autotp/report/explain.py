"""Why an op got its placement: each strategy it had, and what it would have cost with its neighbours fixed.

For every strategy of the op: compute (forward, and backward when training),
its own inner collectives, the redistributions of its inputs from the layouts
their producers were given (incoming), the redistributions of its output to
the layouts its consumers were given (outgoing), and the memory it keeps per
device. These are the cost functions the ILP's problem is built from
(`autotp.solve.problem`). The ILP chose jointly over all ops, so the cheapest
row here is not always the chosen one: a choice can pay locally to save
elsewhere (a redistribution shared with other uses of the same tensor, a
gradient sum hidden behind the backward pass, or the choice of an identical
layer it must share).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from autotp.cost.comm import inner_time_s
from autotp.cost.compute import compute_time_s
from autotp.cost.memory import node_memory_bytes
from autotp.cost.reshard import edge_times_s
from autotp.errors import AutotpError
from autotp.graph.opgraph import KIND_PARAM
from autotp.placement import R
from autotp.report.table import align, format_seconds
from autotp.units import format_bytes


class ExplainError(AutotpError, ValueError):
    """The name given to explain is neither an op of the plan nor a parameter."""


@dataclass(frozen=True)
class Option:
    """One strategy of an op and its cost at the chosen neighbours' layouts."""

    strategy: str
    compute_s: float
    inner_s: float
    incoming_s: float
    outgoing_s: float
    memory_bytes: int
    chosen: bool

    @property
    def total_s(self) -> float:
        return self.compute_s + self.inner_s + self.incoming_s + self.outgoing_s


def resolve(graph, plan, name: str) -> list[str]:
    """An op name, or a parameter name -> the ops consuming that parameter."""
    if name in plan.nodes and graph.graph.has_node(name) and graph.node(name).kind != KIND_PARAM:
        return [name]
    params = {op.fqn: op.name for op in graph.nodes() if op.kind == KIND_PARAM}
    if name in params:
        return [consumer for consumer, _ in graph.consumers(params[name])]
    close = difflib.get_close_matches(name, list(params) + list(plan.nodes), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "use an op name from the plan's nodes or a parameter name"
    raise ExplainError(f"{name!r} is neither an op nor a parameter of this plan: {hint}")


def _edge_s(src, dst, meta, mesh, profile, training, grad, grad_axes, multi_output) -> float:
    if multi_output and src != dst:
        return math.inf  # the pieces of split/chunk are taken as they are produced
    return sum(edge_times_s(src, dst, meta, mesh, profile, training, grad, grad_axes))


def explain_node(graph, strategies, chosen: dict, name: str, mesh, profile, training: bool) -> list[Option]:
    """Every strategy of ``name`` costed against its neighbours' chosen layouts."""
    op = graph.node(name)
    options = []
    for s in strategies.by_node[name]:
        incoming = 0.0
        for i, producer in enumerate(op.inputs):
            src_op = graph.node(producer)
            meta = op.in_metas[i]
            grad = op.requires_grad and src_op.requires_grad and meta.is_float
            incoming += _edge_s(chosen[producer].out, s.ins[i], meta, mesh, profile, training, grad,
                                s.grad_allreduce_axes(i), src_op.multi_output)
        outgoing = 0.0
        for consumer, indices in graph.consumers(name):
            c_op, c = graph.node(consumer), chosen[consumer]
            for i in indices:
                meta = c_op.in_metas[i]
                grad = c_op.requires_grad and op.requires_grad and meta.is_float
                outgoing += _edge_s(s.out, c.ins[i], meta, mesh, profile, training, grad,
                                    c.grad_allreduce_axes(i), op.multi_output)
        if name in graph.outputs:
            outgoing += sum(_edge_s(s.out, (R,) * mesh.ndim, meta, mesh, profile, training,
                                    op.requires_grad and meta.is_float, (), False) for meta in op.out)
        options.append(Option(describe(s), compute_time_s(op, s, mesh, profile, training),
                              inner_time_s(op, s, mesh, profile, training), incoming, outgoing,
                              sum(node_memory_bytes(op, s, mesh, training).values()), s == chosen[name]))
    return options


def _layout(layout) -> str:
    return str(layout[0]) if len(layout) == 1 else "[" + " ".join(str(p) for p in layout) + "]"


def describe(strategy) -> str:
    """``([S(2) S(2)], [S(1) S(1)]) -> [P P]``: each input's layout, then the output's, one entry per mesh axis."""
    impl = f" [{strategy.impl}]" if strategy.impl else ""
    return f"({', '.join(_layout(layout) for layout in strategy.ins)}) -> {_layout(strategy.out)}{impl}"


def _fmt(s: float) -> str:
    return "impossible" if math.isinf(s) else format_seconds(s)


def format_explanation(graph, plan, name: str, options: list[Option]) -> str:
    op = graph.node(name)
    scope = plan.scopes.get(name, "")
    head = [f"{name} ({op.op_name}{', in ' + scope if scope else ''}): inputs "
            f"{', '.join(str(m) for m in op.in_metas) or 'none'} -> {', '.join(str(m) for m in op.out)}"]
    if name in plan.fallback_ops:
        head.append(f"replicated because {plan.fallback_ops[name]}")
    possible = [o for o in options if not math.isinf(o.total_s) or o.chosen]
    rows = [["*" if o.chosen else "", o.strategy, _fmt(o.compute_s), _fmt(o.inner_s), _fmt(o.incoming_s),
             _fmt(o.outgoing_s), _fmt(o.total_s), format_bytes(o.memory_bytes)]
            for o in sorted(possible, key=lambda o: (o.total_s, o.strategy))]
    table = align(["", "strategy (inputs) -> output", "compute", "inner comm", "incoming", "outgoing", "total",
                   "memory"], rows, left=2)
    note = ["(* marks the chosen strategy; incoming/outgoing: redistributions, forward and, when training, "
            "backward, from and to the layouts the plan gave this op's neighbours)"]
    if len(possible) < len(options):
        note.append(f"({len(options) - len(possible)} more strategies are impossible next to these neighbours: "
                    "they need an input in a layout its producer's cannot be turned into, such as a partial sum)")
    return "\n".join(head + table + note)
