"""Recomputed layers: each stretch of a layer's compute between collectives runs under activation checkpointing.

A plan that recomputes a layer (``plan.recompute``, `autotp.solve.recompute`)
keeps only what leaves each stretch of that layer's ops and recomputes the
rest in backward. The rank program's collectives stay outside the
checkpointed stretches, so backward never issues a collective twice and
every rank issues the same ones in the same order; what a collective
returns is kept (the cost model counts a sum's result on its use:
`autotp.cost.memory.kept_use_bytes`), except where the plan regathers it:
an all-gather whose output only the layer reads then joins the stretch, so
the checkpoint keeps its input, and recomputing the stretch gathers again
(`autotp.lower.regather`); so does a collective matmul
(`autotp.lower.collective_matmul`), which recomputation runs again, ring
and all. A stretch is a maximal
run of consecutive ATen ops of the layer: a module call (a collective, an
op's own implementation such as a vocabulary-parallel loss, which may hold
collectives) or any node the lowering added ends it:

    # before: ... linear_3 -> all_reduce_tp -> add_2 -> layer_norm_1 -> linear_4 ...
    # after:  ... recompute_model_layers_3_0(...) -> all_reduce_tp -> recompute_model_layers_3_1(...) ...

Each stretch becomes a small GraphModule run by ``torch.utils.checkpoint``
(non-reentrant, the RNG state preserved, so dropout draws the same masks
when recomputed): the same ops on the same values, so training is exact.
"""

from __future__ import annotations

import operator

from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autotp.graph.signature import layer_path
from autotp.lower.collective_matmul import FUSED, GatherMatmul
from autotp.lower.regather import regathering_nodes


class Recomputed(nn.Module):
    """Runs ``inner`` under activation checkpointing: its intermediate tensors are rebuilt in backward."""

    def __init__(self, inner: fx.GraphModule):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def recompute_layers(gm: fx.GraphModule, graph, layers) -> int:
    """Checkpoint the stretches of every layer in ``layers`` (module paths) in place; returns how many."""
    wanted = set(layers)
    if not wanted:
        return 0
    layer = {op.name: path for op in graph.nodes() if (path := layer_path(op)) is not None}
    inside = _regathering_inside(gm, layer)
    stretches, run, owner = [], [], None
    for node in gm.graph.nodes:  # a module call (a collective, or an op's own implementation) ends a stretch
        mine = _owner(node, layer, inside)
        if mine is not None and mine in wanted and (not run or mine == owner):
            run.append(node)
            owner = mine
            continue
        if run:
            stretches.append((owner, run))
        run, owner = ([node], mine) if mine is not None and mine in wanted else ([], None)
    if run:
        stretches.append((owner, run))
    counts: dict[str, int] = {}
    for owner, nodes in stretches:
        k = counts[owner] = counts.get(owner, -1) + 1
        _checkpoint(gm, nodes, f"recompute_{owner.replace('.', '_')}_{k}")
    gm.graph.lint()
    gm.recompile()
    return len(stretches)


def _owner(node: fx.Node, layer: dict, inside: dict) -> str | None:
    """The layer whose stretch ``node`` may join: an ATen op's, a collective matmul's (its matmul's), or a
    regathering collective's that only one layer reads (`_regathering_inside`)."""
    if FUSED in node.meta:
        return layer.get(node.meta[FUSED])
    return layer.get(node.name) if node.op == "call_function" else inside.get(node)


def _regathering_inside(gm: fx.GraphModule, layer: dict) -> dict[fx.Node, str]:
    """Regathering collectives (`autotp.lower.regather`) whose every user is in one layer: that layer's, so the
    checkpoint keeps their input, the shard, and its recomputation gathers again."""
    inside: dict[fx.Node, str] = {}
    for node in reversed(regathering_nodes(gm)):  # a later step first: the one before it may feed only it
        owners = {_owner(u, layer, inside) for u in node.users}
        if len(owners) == 1 and None not in owners:
            inside[node] = owners.pop()
    return inside


def _checkpoint(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> None:
    """Replace ``nodes`` (consecutive) by one call of a checkpointed module computing the same outputs."""
    inside = set(nodes)
    for n in nodes:  # a collective matmul recomputed keeps its gathered input for its backward, as it was
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GatherMatmul):
            gm.get_submodule(n.target).recomputed = True
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    sub = fx.Graph()
    env = {n: sub.placeholder(f"in_{i}") for i, n in enumerate(inputs)}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, Recomputed(fx.GraphModule(gm, sub)))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        results = [gm.graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    for n, result in zip(outputs, results):
        result.meta = dict(n.meta)
        n.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)


__all__ = ["Recomputed", "recompute_layers"]
