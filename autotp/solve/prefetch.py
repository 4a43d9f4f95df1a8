"""ZeRO's parameter all-gathers after the optimizer step, hidden behind the next forward pass.

A parameter whose optimizer state is split (ZeRO-1 or 2) is put back
together after every optimizer step by an all-gather over the split axes
(`autotp.cost.comm.optimizer_gather`). Nothing needs it until the next
forward pass reaches its first use, so the runtime starts every such
all-gather when the step ends, one after another on one queue in the order
of first use, and the forward pass waits for each only just before that use
(`autotp.runtime.optimizer`; Megatron-LM's distributed optimizer with
``overlap_param_gather`` does the same).

Take *stages* in the order of first use: ``g_s`` the all-gather seconds of
the parameters first used by one op, ``c_s`` the forward compute from the
previous stage's op up to this one. The queue never idles, so gather ``s``
ends at ``G_s = g_1 + ... + g_s``; the forward pass gets there at ``C_s =
c_1 + ... + c_s`` plus what it has already waited. So the step waits

    wait = max(0, max_s (G_s - C_s))

in all: a maximum of linear terms, which the ILP bounds from below row by
row (`autotp.solve.ilp`). A run of ``n`` identical layers adds the same ``g -
c`` per layer, so over the run each stage's term is largest at its first or
its last layer: two rows per stage of a layer, whatever ``n`` is.

The stages are those of the gradient chain turned forward (`Chain`, with
``reduce_nodes`` the gather seconds and ``before`` the forward compute).
Simplifications, in docs/cost-model.md: only compute hides a gather (the
forward's own collectives run on other links, and are not counted as
cover); with micro-batches, only the first one's forward can hide them,
since the gathers run once a step.
"""

from __future__ import annotations

import bisect

from autotp.cost.comm import optimizer_time_s
from autotp.cost.compute import forward_time_s
from autotp.graph.opgraph import KIND_PARAM
from autotp.solve.chain import Chain, Stage, add_terms, fold_blocks, stage_value


def build_prefetch(graph, problem, mesh, profile) -> Chain | None:
    """The stages of the optimizer's all-gathers in forward order, or None when no parameter's state can split."""
    position = {name: i for i, name in enumerate(graph.order)}
    stages: dict[int, Stage] = {}
    for op in graph.nodes():
        if op.kind != KIND_PARAM or not graph.consumers(op.name):
            continue
        group = problem.groups[problem.group_of[op.name]]
        seconds = [optimizer_time_s(op, problem.strategy(op.name, c), mesh, profile) for c in range(group.n)]
        if not any(seconds):
            continue
        first = min(position[consumer] for consumer, _ in graph.consumers(op.name))
        add_terms(stages.setdefault(first, Stage(first)).reduce_nodes, group.leader, seconds)
    if not stages:
        return None
    order = sorted(stages.values(), key=lambda s: s.position)
    starts = [s.position for s in order]
    memo: dict[str, list[float]] = {}
    for op in graph.nodes():
        s = bisect.bisect_right(starts, position[op.name])  # an op at a stage's own position runs after its wait
        if s == len(order):
            continue  # runs after the last wait: hides nothing
        twin, group = problem.sharing.of(op.name), problem.groups[problem.group_of[op.name]]
        if twin not in memo:
            memo[twin] = [forward_time_s(op, problem.strategy(op.name, c), mesh, profile) for c in range(group.n)]
        if any(memo[twin]):
            add_terms(order[s].before, group.leader, list(memo[twin]))
    return Chain(fold_blocks(graph, order))


def prefetch_times_s(chain: Chain, choice: dict[str, int]) -> tuple[float, float]:
    """``(all-gather seconds in all, seconds the forward pass waits for them)`` for one choice of every group."""
    total = lead = wait = 0.0
    for block in chain.blocks:
        for _ in range(block.repeat):
            for stage in block.stages:
                gather = stage_value(stage.reduce_nodes, {}, choice)
                total += gather
                lead += gather - stage_value(stage.before, {}, choice)
                wait = max(wait, lead)
    return total, wait
