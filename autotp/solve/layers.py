"""Identical layers share one set of ILP variables.

A Llama-2-70B has 80 decoder layers that differ only in their weights. Their
ops have the same shapes, so they have the same strategies and the same costs;
giving each layer its own variables makes the ILP 80 times larger for nothing
and lets solve time grow with depth. Here the groups of every layer are folded
into the groups of the first layer with the same structure: one choice is
made for all of them, and their costs add up. Each layer's edges are still costed on their own (the first layer's
input comes from the embedding, the others' from the previous layer).

This is a restriction, like every plan tool's "same plan for every block":
layers are forced alike. Layers whose structure differs (a first layer fed by
the embedding may prune differently) simply form their own class.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autotp.graph.opgraph import OpGraph
from autotp.graph.signature import layer_of, op_signature


@dataclass
class Sharing:
    """Which nodes were folded onto which: ``canon`` maps a node to its twin in the class's first layer."""

    canon: dict[str, str] = field(default_factory=dict)
    classes: list[list[tuple[str, int]]] = field(default_factory=list)  # layers per class, first = template

    def of(self, name: str) -> str:
        return self.canon.get(name, name)

    def summary(self) -> dict[str, int]:
        """``{"layers": layers seen in repeated classes, "layer_classes": classes that share}``."""
        shared = [c for c in self.classes if len(c) > 1]
        return {"shared_layers": sum(len(c) for c in shared), "layer_classes": len(shared)}


def layer_nodes(graph: OpGraph) -> dict[tuple[str, int], list[str]]:
    """Nodes of each numbered layer, in program order."""
    layers = defaultdict(list)
    for op in graph.nodes():
        layer = layer_of(op)
        if layer is not None:
            layers[layer].append(op.name)
    return dict(layers)


def _structure(graph: OpGraph, nodes: list[str], strategies, groups, group_of, alike: "_Alike") -> tuple:
    """What must match for two layers to share choices: ops, strategies, and how they group."""
    position = {name: i for i, name in enumerate(nodes)}
    rows = []
    for name in nodes:
        leader = group_of[name]
        where = ("in", position[leader]) if leader in position else ("out", leader)
        rows.append((op_signature(graph.node(name)), tuple(map(alike, strategies.by_node[name])), where,
                     tuple(groups[leader].choices[name])))
    return tuple(rows)


class _Alike:
    """Numbers strategies by equality, hashing each strategy object once: the ops of identical layers hold the
    same objects (`autotp.strategies.enumerate`), and a strategy's hash walks every placement of its layouts
    (Llama-2-70B's 80 layers on 4x8 hashed 119,040 strategies, of 983 distinct objects)."""

    def __init__(self):
        self.by_id: dict[int, int] = {}
        self.numbers: dict = {}

    def __call__(self, strategy) -> int:
        number = self.by_id.get(id(strategy))
        if number is None:
            number = self.by_id[id(strategy)] = self.numbers.setdefault(strategy, len(self.numbers))
        return number


def share_identical_layers(graph: OpGraph, strategies, groups: dict, group_of: dict) -> Sharing:
    """Fold the groups of each layer onto the first layer of its class; edits ``groups`` and ``group_of``."""
    layers = layer_nodes(graph)
    classes: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
    alike = _Alike()  # the strategies stay alive in ``strategies`` meanwhile: their ids are theirs alone
    for layer in sorted(layers):
        key = (layer[0], _structure(graph, layers[layer], strategies, groups, group_of, alike))
        classes[key].append(layer)
    sharing = Sharing(classes=list(classes.values()))
    for members in sharing.classes:
        template = layers[members[0]]
        for layer in members[1:]:
            _fold(layers[layer], template, groups, group_of, sharing)
    return sharing


def _fold(nodes: list[str], template: list[str], groups: dict, group_of: dict, sharing: Sharing) -> None:
    """Move each group led from inside a layer, members and all, into its twin's group in ``template``."""
    twin = dict(zip(nodes, template))
    sharing.canon.update(twin)
    for leader in sorted({group_of[name] for name in nodes} & set(nodes), key=nodes.index):
        target = groups[twin[leader]]
        for member, picks in groups.pop(leader).choices.items():
            target.choices[member] = picks
            group_of[member] = target.leader
