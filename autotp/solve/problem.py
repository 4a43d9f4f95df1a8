"""The planning problem before the solver sees it: groups of ops, their cost vectors and edge tables.

Follower merging (Alpa's): a pointwise op or view that can take its first
producer's choice, for every choice that producer has, joins the producer's
group and adds no variables. Edge costs between groups become matrices; an edge
touching a single-choice group folds into the other side's cost vector.

Every cost has two parts: exposed seconds, and the gradient reductions of
parameters, which hide behind the backward pass up to its compute time
(`ilp` takes ``max(0, overlappable - backward)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotp.cost.comm import inner_time_s
from autotp.cost.compute import backward_time_s, compute_time_s
from autotp.cost.memory import node_memory_bytes
from autotp.cost.reshard import edge_time_s, edge_times_s
from autotp.graph.opgraph import KIND_PARAM, OpGraph
from autotp.placement import R
from autotp.strategies.enumerate import OpStrategies


@dataclass
class Group:
    """A leader op and the followers whose strategy is a function of the leader's."""

    leader: str
    choices: dict[str, list[int]] = field(default_factory=dict)  # member -> strategy index per leader choice
    cost_s: list[float] = field(default_factory=list)  # exposed time per choice
    overlap_s: list[float] = field(default_factory=list)  # gradient reductions that can hide behind backward
    backward_s: list[float] = field(default_factory=list)  # backward compute they can hide behind
    memory_bytes: list[int] = field(default_factory=list)  # per device, summed over members

    @property
    def n(self) -> int:
        return len(self.choices[self.leader])


@dataclass
class Problem:
    """Everything the ILP needs, with names that point back at fx nodes."""

    groups: dict[str, Group]
    group_of: dict[str, str]
    edges: dict[tuple[str, str], list[list[float]]]  # exposed seconds per pair of choices
    strategies: OpStrategies
    overlap_edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    overlap_gradients: bool = False

    def strategy(self, node: str, choice: int):
        group = self.groups[self.group_of[node]]
        return self.strategies.by_node[node][group.choices[node][choice]]


def _follow_choice(op, produced, strategies: OpStrategies):
    """Index of ``op``'s strategy that consumes ``produced`` on input 0 as is, or None.

    Strategies are already pruned (`prune_unreachable`), so every partial sum a
    candidate needs from its other inputs can be produced.
    """
    return next((idx for idx, s in enumerate(strategies.by_node[op.name]) if s.ins[0] == produced), None)


def build_groups(graph: OpGraph, strategies: OpStrategies) -> tuple[dict[str, Group], dict[str, str]]:
    groups, group_of = {}, {}
    for op in graph.nodes():
        if op.name in strategies.followers and op.inputs:
            producer = op.inputs[0]
            group = groups[group_of[producer]]
            picks = [_follow_choice(op, strategies.by_node[producer][i].out, strategies)
                     for i in group.choices[producer]]
            if all(p is not None for p in picks):
                group.choices[op.name] = picks
                group_of[op.name] = group.leader
                continue
        groups[op.name] = Group(op.name, {op.name: list(range(len(strategies.by_node[op.name])))})
        group_of[op.name] = op.name
    return groups, group_of


def build_problem(graph: OpGraph, strategies: OpStrategies, mesh, profile, training: bool,
                  overlap_gradients: bool = False) -> Problem:
    """Cost every group choice and every cross-group edge in seconds.

    With ``overlap_gradients`` the reductions of parameter gradients are kept
    apart, to hide behind the backward compute; otherwise they are exposed.
    """
    groups, group_of = build_groups(graph, strategies)
    problem = Problem(groups, group_of, {}, strategies, overlap_gradients=overlap_gradients)
    for group in groups.values():
        group.cost_s, group.memory_bytes = [0.0] * group.n, [0] * group.n
        group.overlap_s, group.backward_s = [0.0] * group.n, [0.0] * group.n
    for op in graph.nodes():
        group = groups[group_of[op.name]]
        for c in range(group.n):
            strategy = problem.strategy(op.name, c)
            group.cost_s[c] += compute_time_s(op, strategy, mesh, profile, training)
            group.backward_s[c] += backward_time_s(op, strategy, mesh, profile, training)
            group.cost_s[c] += inner_time_s(op, strategy, mesh, profile)
            group.memory_bytes[c] += sum(node_memory_bytes(op, strategy, mesh, training).values())
    for op in graph.nodes():
        for i, producer in enumerate(op.inputs):
            _add_edge(problem, graph, producer, op, i, mesh, profile, training)
    for name in graph.outputs:
        _add_output(problem, graph, name, mesh, profile, training)
    return problem


def _edge_cost(problem, graph, producer, op, i, cu, cv, mesh, profile, training) -> tuple[float, float]:
    """``(exposed, overlappable)`` seconds of one edge for one pair of choices."""
    src = problem.strategy(producer, cu).out
    s = problem.strategy(op.name, cv)
    meta = op.in_metas[i]
    if graph.node(producer).multi_output and src != s.ins[i]:
        return math.inf, 0.0  # the pieces of split/chunk are taken as they are produced
    grad = op.requires_grad and graph.node(producer).requires_grad and meta.is_float
    return edge_times_s(src, s.ins[i], meta, mesh, profile, training, grad, s.grad_allreduce_axes(i),
                        from_parameter=problem.overlap_gradients and graph.node(producer).kind == KIND_PARAM)


def _add_edge(problem, graph, producer, op, i, mesh, profile, training) -> None:
    gu, gv = problem.group_of[producer], problem.group_of[op.name]
    nu, nv = problem.groups[gu].n, problem.groups[gv].n
    if gu == gv:  # both ends are fixed by the same choice
        group = problem.groups[gu]
        for c in range(group.n):
            exposed, overlap = _edge_cost(problem, graph, producer, op, i, c, c, mesh, profile, training)
            group.cost_s[c] += exposed
            group.overlap_s[c] += overlap
        return
    pairs = [[_edge_cost(problem, graph, producer, op, i, cu, cv, mesh, profile, training) for cv in range(nv)]
             for cu in range(nu)]
    if nu == 1 or nv == 1:  # fold into the side that has a choice
        for cu in range(nu):
            for cv in range(nv):
                target, c = (problem.groups[gv], cv) if nu == 1 else (problem.groups[gu], cu)
                target.cost_s[c] += pairs[cu][cv][0]
                target.overlap_s[c] += pairs[cu][cv][1]
        return
    for edges, k in ((problem.edges, 0), (problem.overlap_edges, 1)):
        table = [[pair[k] for pair in row] for row in pairs]
        if k == 1 and not any(any(row) for row in table):
            continue
        old = edges.get((gu, gv))
        edges[(gu, gv)] = table if old is None else [[a + b for a, b in zip(r0, r1)] for r0, r1 in zip(old, table)]


def _add_output(problem, graph, name, mesh, profile, training) -> None:
    """Outputs are returned whole on every rank: each pays its way to R."""
    op = graph.node(name)
    group = problem.groups[problem.group_of[name]]
    r = (R,) * len(mesh.shape)
    for c in range(group.n):
        src = problem.strategy(name, c).out
        for meta in op.out:
            group.cost_s[c] += edge_time_s(src, r, meta, mesh, profile, training, op.requires_grad and meta.is_float)
