"""Activation recomputation as a choice of the ILP: per class of identical layers, how many of them to recompute.

A recomputed layer keeps, of its activations, only the tensors that leave it
(its output, which the next layer or the head reads anyway) and the inputs it
reads from outside; in backward it runs its forward again, one layer at a
time, to rebuild the rest (`torch.utils.checkpoint`, lowered in
`autotp.lower.recompute`). Of a class of ``count`` identical layers any
number ``n`` may be recomputed (Megatron-LM's ``--recompute-num-layers``;
the lowering takes the first ``n``), and each one recomputed:

* costs the forward compute of its ops once more (the collectives between
  them are not re-run: the lowering checkpoints the stretches of compute
  between collectives, and a collective's output is kept);
* frees the activation bytes of every op but the layer's outputs and the
  partial sums it all-reduces (the lowering cuts the layer at each
  collective and keeps what a collective returns, which the memory model
  counts whether or not the layer is recomputed: `autotp.cost.memory`);
* needs, while it is rebuilt, its activations back: the step's memory holds
  the largest such transient of one layer of any recomputed class.

Both depend on the ops' choices, so the ILP writes ``n`` in binary, ``n =
sum_j 2^j b_j <= count``, and per bit and group, with ``F`` the group's
forward seconds over the class under its choice, ``A`` its freed bytes and
``M`` their maxima, a time ``t >= 2^j/count (F(x) - M (1 - b_j))`` and freed
bytes ``z <= 2^j/count A(x)``, ``z <= 2^j/count M b_j`` (McCormick's
envelope, exact for a binary ``b_j``), with ``transient >= sum(z) / 2^j``
per bit: one layer's share. It is added only when memory is limited or
minimised: otherwise recomputing only costs.

Layers whose ops update a tensor in place (BatchNorm's running statistics)
are never recomputed: a second forward would update it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.cost.compute import forward_time_s
from autotp.cost.memory import node_memory_bytes
from autotp.graph.flops import is_alias
from autotp.graph.opgraph import KIND_OP
from autotp.placement import Partial
from autotp.solve.layers import layer_nodes
from autotp.strategies.inplace import INPLACE_UPDATES


@dataclass
class Recompute:
    """One class of identical layers that may be recomputed, its costs per group choice summed over the class."""

    layers: list[str]  # module paths, e.g. ["model.layers.0", ..., "model.layers.79"]
    forward_s: dict[str, list[float]] = field(default_factory=dict)  # group -> forward seconds per choice
    saved_bytes: dict[str, list[int]] = field(default_factory=dict)  # group -> activation bytes freed per choice

    @property
    def count(self) -> int:
        return len(self.layers)


def recompute_classes(graph, problem, mesh, profile, precision: str) -> list[Recompute]:
    """The classes of identical layers (`problem.sharing`, or each layer alone) that can be recomputed."""
    layers = layer_nodes(graph)
    classes = problem.sharing.classes or [[layer] for layer in sorted(layers)]
    out = []
    for members in classes:
        template = layers[members[0]]
        if any(_updates_in_place(graph.node(name)) for m in members for name in layers[m]):
            continue
        rc = Recompute([f"{path}.{index}" for path, index in members])  # as `layer_path` names them
        inside = set(template)
        for name in template:
            op = graph.node(name)
            if op.kind != KIND_OP or not op.requires_grad or is_alias(op.target):
                continue
            leaves = any(consumer not in inside for consumer, _ in graph.consumers(name)) or name in graph.outputs
            group = problem.groups[problem.group_of[name]]
            forward = rc.forward_s.setdefault(group.leader, [0.0] * group.n)
            saved = rc.saved_bytes.setdefault(group.leader, [0] * group.n)
            for c in range(group.n):
                strategy = problem.strategy(name, c)
                forward[c] += rc.count * problem.micro_batches * forward_time_s(op, strategy, mesh, profile)
                if not (leaves or _summed_after(strategy, mesh)):
                    saved[c] += rc.count * node_memory_bytes(op, strategy, mesh, True, precision).get("activations", 0)
        if any(any(v) for v in rc.saved_bytes.values()):
            out.append(rc)
    return out


def _summed_after(strategy, mesh) -> bool:
    """A partial sum (P) is all-reduced before use: the lowering keeps the sum, of the same size, for backward."""
    return any(isinstance(p, Partial) and mesh.shape[a] > 1 for a, p in enumerate(strategy.out))


def _updates_in_place(op) -> bool:
    return op.kind == KIND_OP and getattr(op.target, "_opname", "") in INPLACE_UPDATES


def recompute_effect(problem, choice: dict[str, int], recomputed) -> tuple[float, int, int]:
    """``(seconds, bytes freed, transient bytes)`` of recomputing ``n`` layers of class ``k`` for each ``(k, n)``
    in ``recomputed``."""
    seconds, freed, transient = 0.0, 0, 0
    for k, n in recomputed:
        rc = problem.recompute[k]
        if n <= 0:
            continue
        seconds += n / rc.count * sum(values[choice[g]] for g, values in rc.forward_s.items())
        one = sum(values[choice[g]] for g, values in rc.saved_bytes.items()) // rc.count  # whole: count divides
        freed += n * one
        transient = max(transient, one)
    return seconds, freed, transient


LAYERS = "layers"  # ``plan(recompute=LAYERS)``: any number of each class's layers, not only all or none


def layer_counts(count: int, partial: bool) -> list[int]:
    """The layers each recompute binary of a class of ``count`` stands for: ``1, 2, 4, ...`` (any number, in
    binary) when ``partial``, else the whole class at once."""
    return [2 ** j for j in range(count.bit_length())] if partial else [count]


def recomputed_layers(problem, recomputed) -> list[str]:
    """The layers (module paths) ``recomputed`` names: the first ``n`` of class ``k`` for each ``(k, n)``."""
    return [layer for k, n in recomputed for layer in problem.recompute[k].layers[:n]]
