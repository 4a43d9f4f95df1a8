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
from collections import Counter
from dataclasses import dataclass, field

from autotp.cost.comm import inner_time_s
from autotp.cost.compute import backward_time_s, compute_time_s
from autotp.cost.memory import node_memory_bytes
from autotp.cost.reshard import edge_time_s, edge_times_s
from autotp.graph.opgraph import KIND_PARAM, OpGraph
from autotp.placement import R
from autotp.solve.layers import Sharing, share_identical_layers
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
    sharing: Sharing = field(default_factory=Sharing)

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
                  overlap_gradients: bool = False, share_layers: bool = True) -> Problem:
    """Cost every group choice and every cross-group edge in seconds.

    With ``overlap_gradients`` the reductions of parameter gradients are kept
    apart, to hide behind the backward compute; otherwise they are exposed.
    With ``share_layers`` identical layers share their choices
    (`autotp.solve.layers`), and each distinct op and edge is costed once and
    counted as often as it occurs.
    """
    groups, group_of = build_groups(graph, strategies)
    sharing = share_identical_layers(graph, strategies, groups, group_of) if share_layers else Sharing()
    problem = Problem(groups, group_of, {}, strategies, overlap_gradients=overlap_gradients, sharing=sharing)
    for group in groups.values():
        group.cost_s, group.memory_bytes = [0.0] * group.n, [0] * group.n
        group.overlap_s, group.backward_s = [0.0] * group.n, [0.0] * group.n
    coster = _Coster(problem, graph, mesh, profile, training)
    nodes = Counter((group_of[op.name], sharing.of(op.name)) for op in graph.nodes())
    for (leader, name), count in nodes.items():
        coster.add_node(groups[leader], graph.node(name), count)
    edges = Counter((sharing.of(producer), sharing.of(op.name), i, group_of[producer], group_of[op.name])
                    for op in graph.nodes() for i, producer in enumerate(op.inputs))
    for (producer, consumer, i, gu, gv), count in edges.items():
        coster.add_edge(producer, graph.node(consumer), i, gu, gv, count)
    for name in graph.outputs:
        coster.add_output(name)
    return problem


@dataclass
class _Coster:
    """Adds costs into a `Problem`; the same redistribution of the same tensor is costed once."""

    problem: Problem
    graph: OpGraph
    mesh: object
    profile: object
    training: bool
    memo: dict = field(default_factory=dict)

    def add_node(self, group: Group, op, count: int) -> None:
        """``count`` ops alike to ``op``: their compute, inner collectives and memory, per group choice."""
        mesh, profile, training = self.mesh, self.profile, self.training
        for c in range(group.n):
            strategy = self.problem.strategy(op.name, c)
            group.cost_s[c] += count * (compute_time_s(op, strategy, mesh, profile, training)
                                        + inner_time_s(op, strategy, mesh, profile))
            group.backward_s[c] += count * backward_time_s(op, strategy, mesh, profile, training)
            group.memory_bytes[c] += count * sum(node_memory_bytes(op, strategy, mesh, training).values())

    def edge_cost(self, producer: str, op, i: int, cu: int, cv: int) -> tuple[float, float]:
        """``(exposed, overlappable)`` seconds of one edge for one pair of choices."""
        src = self.problem.strategy(producer, cu).out
        s = self.problem.strategy(op.name, cv)
        meta, made_by = op.in_metas[i], self.graph.node(producer)
        if made_by.multi_output and src != s.ins[i]:
            return math.inf, 0.0  # the pieces of split/chunk are taken as they are produced
        key = (src, s.ins[i], meta, op.requires_grad and made_by.requires_grad and meta.is_float,
               s.grad_allreduce_axes(i), self.problem.overlap_gradients and made_by.kind == KIND_PARAM)
        if key not in self.memo:
            self.memo[key] = edge_times_s(key[0], key[1], meta, self.mesh, self.profile, self.training, key[3],
                                          key[4], from_parameter=key[5])
        return self.memo[key]

    def add_edge(self, producer: str, op, i: int, gu: str, gv: str, count: int) -> None:
        """``count`` edges alike to ``producer -> op`` (input ``i``) between groups ``gu`` and ``gv``."""
        groups, edges = self.problem.groups, self.problem.edges
        nu, nv = groups[gu].n, groups[gv].n
        if gu == gv:  # both ends are fixed by the same choice
            for c in range(nu):
                exposed, overlap = self.edge_cost(producer, op, i, c, c)
                groups[gu].cost_s[c] += count * exposed
                groups[gu].overlap_s[c] += count * overlap
            return
        pairs = [[self.edge_cost(producer, op, i, cu, cv) for cv in range(nv)] for cu in range(nu)]
        if nu == 1 or nv == 1:  # fold into the side that has a choice
            for cu in range(nu):
                for cv in range(nv):
                    target, c = (groups[gv], cv) if nu == 1 else (groups[gu], cu)
                    target.cost_s[c] += count * pairs[cu][cv][0]
                    target.overlap_s[c] += count * pairs[cu][cv][1]
            return
        for table_of, k in ((edges, 0), (self.problem.overlap_edges, 1)):
            table = [[count * pair[k] for pair in row] for row in pairs]
            if k == 1 and not any(any(row) for row in table):
                continue
            old = table_of.get((gu, gv))
            table_of[(gu, gv)] = table if old is None else [[a + b for a, b in zip(r0, r1)]
                                                            for r0, r1 in zip(old, table)]

    def add_output(self, name: str) -> None:
        """Outputs are returned whole on every rank: each pays its way to R."""
        op = self.graph.node(name)
        group = self.problem.groups[self.problem.group_of[name]]
        r = (R,) * len(self.mesh.shape)
        for c in range(group.n):
            src = self.problem.strategy(name, c).out
            for meta in op.out:
                group.cost_s[c] += edge_time_s(src, r, meta, self.mesh, self.profile, self.training,
                                               op.requires_grad and meta.is_float)
