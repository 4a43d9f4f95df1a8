"""Regathering as a choice of the solver: keep the shard of an all-gathered input, and gather it again in backward.

An op whose backward reads an input that arrived through an all-gather
(a column-parallel matmul after a sequence-parallel norm, or a weight
stored split over a data-parallel axis and gathered at use) keeps the
whole gathered tensor until its backward runs. Regathering keeps only the
shard and runs the gather again when backward needs the tensor: Megatron-LM's
sequence parallelism does so for activations, FSDP's reshard after forward
for parameters (ZeRO-3). Each use regathered

* frees the gathered input's bytes, less the shard's where nothing else
  keeps the shard (`autotp.cost.memory.regather_saving`);
* costs the redistribution's forward steps once more per micro-batch
  (`autotp.cost.reshard.edge_cost`), on the critical path of backward.

Two choices, one per kind, because the trade differs: ``weights`` (the
producer is a parameter: its shard is the parameter itself, its gather
often crosses the slow axis) and ``activations``. Each applies to every use
of its kind, as the lowering does (`autotp.lower.regather`), and is offered
only when memory is limited or minimised: otherwise regathering only
costs. With two kinds there are four ways at most, so the solver tries
them (`autotp.solve.ilp`; with a plan to beat, those parted by one kind
bounded together first: `family`), each as the same problem with the regathered
uses' seconds and bytes folded into the pieces they live on (a group, an
edge's pairs, a fan-out item: `folded`). The ILP keeps its size, dead-end
elimination needs no rule of its own, and the choice is exact.

A use inside a recomputed layer is regathered by the recomputation: the
lowering checkpoints the gather with the ops that read it, so the
checkpoint keeps the shard and backward gathers it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import combinations

from autotp.graph.opgraph import KIND_PARAM

WEIGHTS = "weights"
ACTIVATIONS = "activations"
KINDS = (WEIGHTS, ACTIVATIONS)


def regather_kind(producer) -> str:
    """Which binary a use of ``producer``'s output follows: a parameter's, or an activation's."""
    return WEIGHTS if producer.kind == KIND_PARAM else ACTIVATIONS


@dataclass
class Regather:
    """What regathering every use of one kind adds (seconds) and frees (bytes), where those uses are costed.

    ``groups``: a use folded into a group, per choice; ``edges``: per pair of
    choices of an edge's two groups; ``items``: a fan-out item, by
    ``(fan-out index, item)``, once whichever uses need it.
    """

    kind: str
    groups: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    edges: dict[tuple[str, str], tuple[list[list[float]], list[list[int]]]] = field(default_factory=dict)
    items: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    def add_group(self, group, choice: int, seconds: float, freed: int) -> None:
        s, b = self.groups.setdefault(group.leader, ([0.0] * group.n, [0] * group.n))
        s[choice] += seconds
        b[choice] += freed

    def add_pair(self, gu: str, gv: str, nu: int, nv: int, cu: int, cv: int, seconds: float, freed: int) -> None:
        s, b = self.edges.setdefault((gu, gv), ([[0.0] * nv for _ in range(nu)], [[0] * nv for _ in range(nu)]))
        s[cu][cv] += seconds
        b[cu][cv] += freed

    def add_item(self, fanout: int, item: int, seconds: float, freed: int) -> None:
        """One buffer per item, however many uses keep it: its seconds once, the most any use frees."""
        s, b = self.items.get((fanout, item), (0.0, 0))
        self.items[fanout, item] = (max(s, seconds), max(b, freed))


def kind_sets(problem) -> list[tuple[str, ...]]:
    """Every set of the problem's kinds, the largest first (the most memory freed: the likeliest to fit)."""
    kinds = tuple(problem.regather)
    return [c for n in range(len(kinds), -1, -1) for c in combinations(kinds, n)]


def folded(problem, kinds):
    """``problem`` with every use of each kind in ``kinds`` regathered and nothing left to choose: their seconds
    added to, and their freed bytes taken from, the costs and memory of the pieces they live on."""
    return family(problem, kinds, ())


def least_of_sets(problem):
    """``problem`` with each piece at its least seconds and least bytes over every set of kinds (`family`, every
    kind free): its optimum, and its relaxation's, bound all sets' at once (`autotp.solve.ilp` prunes a
    micro-batch count on one relaxation rather than one per set)."""
    return family(problem, (), tuple(problem.regather))


def family(problem, on: tuple, free: tuple):
    """The least of the sets that hold every kind in ``on`` and any of ``free``: the kinds in ``on`` folded in
    as `folded` does, and each piece at its least over the kinds in ``free``, only the seconds a regather saves
    (a collective matmul's credit, where it hides more) and every byte it frees.

    Each set's problem adds to every piece the sum of its kinds' seconds and takes the sum of their bytes, so
    this one costs every plan no more, and needs no more memory for it, than any set of the family does: its
    relaxation bounds them all at once. A family is worth bounding where the kinds left free move the step
    little (`split_kind`): at Llama-2-70B batch 8 the sets that do not regather activations bound together at
    1.0705 s (recomputing every layer) and 1.5588 s (none), above the 1.0649 s to beat, where every set
    together bounds at 1.0019 s and 0.9246 s.
    """
    exact = lambda value: value  # noqa: E731
    return _fold(problem, [(kind, exact, exact) for kind in on]
                 + [(kind, lambda seconds: min(seconds, 0.0), lambda freed: max(freed, 0)) for kind in free])


def split_kind(problem) -> str | None:
    """The kind whose regathering weighs most on the step (each of its pieces' largest seconds, summed; None
    where there is none): the sets parted by it (`families`) differ most between the parts, and least within
    one."""
    def weight(r: Regather) -> float:
        return (sum(max(seconds) for seconds, _ in r.groups.values())
                + sum(max(max(row) for row in seconds) for seconds, _ in r.edges.values())
                + sum(seconds for seconds, _ in r.items.values()))
    return max(problem.regather, key=lambda kind: weight(problem.regather[kind]), default=None)


def families(sets: list[tuple], kind: str) -> list[tuple[tuple, tuple, list[tuple]]]:
    """``sets`` parted by whether they hold ``kind``, in order of first appearance: per part, the kinds all its
    sets hold (``on``), those some do (``free``), and its sets; `family` of ``on`` and ``free`` bounds them all."""
    parts: dict[bool, list[tuple]] = {}
    for kinds in sets:
        parts.setdefault(kind in kinds, []).append(kinds)
    out = []
    for members in parts.values():
        every = tuple(dict.fromkeys(k for kinds in members for k in kinds))
        on = tuple(k for k in every if all(k in kinds for kinds in members))
        out.append((on, tuple(k for k in every if k not in on), members))
    return out


def _fold(problem, folds):
    """``problem`` with each ``(kind, seconds_of, freed_of)`` of ``folds`` folded in: ``seconds_of(s)`` added to,
    and ``freed_of(b)`` taken from, each piece's costs and memory, per use regathered (``s`` seconds, ``b`` bytes
    freed)."""
    out = replace(problem, groups=dict(problem.groups), edges=dict(problem.edges),
                  edge_memory=dict(problem.edge_memory), fanouts=list(problem.fanouts), regather={})
    for kind, seconds_of, freed_of in folds:
        r = problem.regather[kind]
        for g, (seconds, freed) in r.groups.items():
            group = out.groups[g]
            out.groups[g] = replace(group, cost_s=[c + seconds_of(s) for c, s in zip(group.cost_s, seconds)],
                                    memory_bytes=[m - freed_of(b) for m, b in zip(group.memory_bytes, freed)])
        for e, (seconds, freed) in r.edges.items():
            out.edges[e] = [[c + seconds_of(s) for c, s in zip(*rows)] for rows in zip(out.edges[e], seconds)]
            if any(any(row) for row in freed):  # a ring's credit alone frees nothing
                out.edge_memory[e] = [[m - freed_of(b) for m, b in zip(*rows)]
                                      for rows in zip(out.edge_memory[e], freed)]
        for (f, k), (seconds, freed) in r.items.items():
            fanout = out.fanouts[f] = replace(out.fanouts[f], cost_s=list(out.fanouts[f].cost_s),
                                              memory_bytes=list(out.fanouts[f].memory_bytes))
            fanout.cost_s[k] += seconds_of(seconds)
            fanout.memory_bytes[k] -= freed_of(freed)
    return out
