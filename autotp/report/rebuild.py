"""Back from a saved plan to what it was made of: the op graph, every op's strategies, and the chosen ones.

Explanations and pictures need more than the plan keeps: the graph's edges and
the strategies each op could have had. They are rebuilt here from the model
with the same stage functions `autotp.plan` calls, so the costs are the ILP's.
"""

from __future__ import annotations

from autotp.api import _as_tuple, _placeholder_grads
from autotp.capture import capture
from autotp.graph import build_opgraph
from autotp.solve.constraints import same_as
from autotp.strategies import default_registry, enumerate_strategies
from autotp.strategies.enumerate import prune_unreachable


def rebuild_graph(model, example_inputs=(), example_kwargs=None, replay_layers: bool = True):
    """The `OpGraph` `autotp.plan` builds for these inputs (node names match the plan's).

    ``replay_layers`` must be what the plan was captured with (`autotp.api.replays_layers`).
    """
    example_inputs, example_kwargs = _as_tuple(example_inputs), dict(example_kwargs or {})
    gm = capture(model, example_inputs, example_kwargs, replay_layers=replay_layers)
    return build_opgraph(gm, _placeholder_grads(gm, example_inputs, example_kwargs))


def all_strategies(graph, mesh, registry=None, training: bool = False):
    """Every op's strategies before any pin or filter, as the ILP starts from them (ZeRO's when ``training``)."""
    strategies = enumerate_strategies(graph, mesh.shape, registry or default_registry(), optimizer_sharding=training)
    prune_unreachable(graph, strategies)
    return strategies


def chosen_strategies(graph, strategies, plan) -> dict:
    """``{node: Strategy}`` the plan chose; a node whose choice is not among ``strategies`` is left out."""
    matches = same_as(plan)
    out = {}
    for op in graph.nodes():
        found = [s for s in strategies.by_node[op.name] if matches(op, s)]
        if found and op.name in plan.nodes:
            out[op.name] = found[0]
    return out
