"""The gradient chain: parameter gradients summed behind the backward pass, and how much of it shows.

In backward a parameter's gradient is ready once the backward of its consumer
(and of everything after it in program order) has run. The runtime
(`autotp.lower.reducer`) sums ready gradients in buckets on one queue per
rank while the backward pass goes on, and waits for the last sum before
``backward()`` returns, as DDP does. Take the *stages* in the order their
gradients become ready (the last consumer first), ``reduce_s`` the gradient
seconds of a stage and ``before_s`` the backward compute since the previous
stage was ready. The queue then lags the compute by

    lag_0 = reduce_0,    lag_s = reduce_s + max(0, lag_{s-1} - before_s)

and the step waits ``exposed = max(0, lag_last - after_s)`` for it, where
``after_s`` is the backward compute left once the last stage is ready. Every
term is linear in the choices, and the ILP writes each ``max`` as two
inequalities (`autotp.solve.ilp`), so the objective is this very number.

A deep stack of identical layers repeats the same stages: a run of ``n``
identical blocks maps an incoming lag ``l`` to ``max(l + n*D, C + (n-1)*D,
C)``, where ``D`` is one block's gradient seconds less its compute and
``C`` the lag one block builds from nothing, since each stage maps ``l`` to
``max(l + r - b, r)`` and such maps compose to the same form. So the chain
of an 80-layer model costs the ILP what 3 layers cost.

With ``k`` micro-batches a step, the gradients that ZeRO-2 reduce-scatters
into optimizer slices (``Strategy.gradient_split``) are summed after every
micro-batch's backward, not once (`autotp.lower.reducer`: the whole
gradient never outlives its bucket, as in DeepSpeed's ZeRO-2); the others
accumulate whole and are summed once, after the last. So the ``k - 1``
earlier backward passes each run a chain of their own, the *early* chain:
the same stages and compute, with only the sliced gradients' seconds, and
each waits for its queue at its end as the last one does. The step pays
``k - 1`` times its wait, and its gradient seconds ``k - 1`` times over.

The model's simplifications, all documented in docs/cost-model.md: a
gradient starts as soon as it is ready (a bucket waits for its last member;
the bucket's latency is shared out by bytes instead, `bucketed_step_time_s`);
one queue per rank (sums on different mesh axes could run side by side); and
the activation collectives of the backward pass do not hide gradient sums.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from autotp.cost.compute import backward_time_s
from autotp.graph.signature import layer_of


@dataclass
class Stage:
    """The gradient sums that become ready together, at the backward of the op at ``position``."""

    position: int
    reduce_nodes: dict[str, list[float]] = field(default_factory=dict)  # group -> seconds per choice
    reduce_pairs: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)  # edge -> per pair
    before: dict[str, list[float]] = field(default_factory=dict)  # backward compute since the last stage


@dataclass
class Block:
    """Consecutive stages, ``repeat`` times over (the stages of one layer of a run of identical layers)."""

    stages: list[Stage]
    repeat: int = 1


@dataclass
class Chain:
    """Blocks of stages in the order their gradients are ready, and the backward compute after the last."""

    blocks: list[Block]
    after: dict[str, list[float]] = field(default_factory=dict)
    early: "Chain | None" = None  # the sliced gradients' chain, run by each of the ``earlier`` micro-batches
    earlier: int = 0  # micro-batches before the last: k - 1


def add_terms(terms: dict, key, values) -> None:
    """``terms[key] += values``, per choice (a list) or per pair of choices (a list of lists); a new list."""
    if key in terms:
        old = terms[key]
        terms[key] = ([a + b for a, b in zip(old, values)] if not isinstance(values[0], list)
                      else [[a + b for a, b in zip(r0, r1)] for r0, r1 in zip(old, values)])
    else:
        terms[key] = values


def build_chain(graph, problem, deferred: set[str], gradient_table, mesh, profile, training: bool,
                micro_batches: int = 1) -> Chain:
    """The stages of the ``deferred`` parameters' gradient sums, and the backward compute between them.

    ``gradient_table(param, consumer, i)`` gives a deferred use's gradient
    seconds per pair of choices (`autotp.solve.problem`). With several
    ``micro_batches`` the chain carries the early one, where some choice
    slices a gradient.
    """
    position = {name: i for i, name in enumerate(graph.order)}
    stages: dict[int, Stage] = {}
    sliced: dict[int, Stage] = {}  # the same stages, with only the seconds of choices that slice the gradient
    for param in sorted(deferred, key=position.get):
        (consumer, i), = [(op, i) for op, _ in graph.consumers(param)
                          for i, producer in enumerate(graph.node(op).inputs) if producer == param]
        stage = stages.setdefault(position[consumer], Stage(position[consumer]))
        gu, gv = problem.group_of[param], problem.group_of[consumer]
        table = gradient_table(param, consumer, i)
        _add_use(stage, problem, gu, gv, table)
        slices = [problem.strategy(param, c).gradient_split for c in range(problem.groups[gu].n)]
        if micro_batches > 1 and any(slices):
            own = sliced.setdefault(position[consumer], Stage(position[consumer]))
            _add_use(own, problem, gu, gv, [row if cut else [0.0] * len(row) for row, cut in zip(table, slices)])
    order = sorted(stages.values(), key=lambda s: -s.position)
    after: dict[str, list[float]] = {}
    starts = [-s.position for s in order]  # ascending, for bisect
    memo: dict[str, list[float]] = {}
    for op in graph.nodes():
        twin, group = problem.sharing.of(op.name), problem.groups[problem.group_of[op.name]]
        if twin not in memo:
            memo[twin] = [backward_time_s(op, problem.strategy(op.name, c), mesh, profile, training)
                          for c in range(group.n)]
        if not any(memo[twin]):
            continue
        s = bisect.bisect_left(starts, -position[op.name])  # stages ready before this op's backward runs
        if s == 0:
            continue  # runs before any gradient is ready: hides nothing
        target = after if s == len(order) else order[s].before
        add_terms(target, group.leader, list(memo[twin]))
    chain = Chain(fold_blocks(graph, order), after)
    if sliced:
        early = [replace(sliced.get(s.position, Stage(s.position)), before=s.before) for s in order]
        chain.early, chain.earlier = Chain(fold_blocks(graph, early), after), micro_batches - 1
    return chain


def _add_use(stage: Stage, problem, gu: str, gv: str, table) -> None:
    """A deferred use's gradient seconds (per pair of parameter and consumer choices) into ``stage``."""
    if problem.groups[gu].n == 1:
        add_terms(stage.reduce_nodes, gv, [t for t in table[0]])
    elif problem.groups[gv].n == 1:
        add_terms(stage.reduce_nodes, gu, [row[0] for row in table])
    else:
        add_terms(stage.reduce_pairs, (gu, gv), table)


def _terms(stage: Stage) -> tuple:
    """What must match for two stages to be the same stage of two identical layers."""
    return (sorted((k, tuple(v)) for k, v in stage.reduce_nodes.items()),
            sorted((k, tuple(map(tuple, v))) for k, v in stage.reduce_pairs.items()),
            sorted((k, tuple(v)) for k, v in stage.before.items()))


def fold_blocks(graph, order: list[Stage]) -> list[Block]:
    """Stages cut into layers (by the layer of each stage's consumer), runs of identical layers folded."""
    layers: list[tuple[object, list[Stage]]] = []
    for stage in order:
        layer = layer_of(graph.node(graph.order[stage.position]))
        if layers and layer is not None and layers[-1][0] == layer:
            layers[-1][1].append(stage)
        else:
            layers.append((layer, [stage]))
    blocks: list[Block] = []
    for layer, stages in layers:
        last = blocks[-1] if blocks else None
        if (last is not None and layer is not None and len(last.stages) == len(stages)
                and all(_terms(a) == _terms(b) for a, b in zip(last.stages, stages))):
            last.repeat += 1
        else:
            blocks.append(Block(stages))
    return blocks


def stage_value(nodes: dict, pairs: dict, choice: dict) -> float:
    return (sum(v[choice[g]] for g, v in nodes.items())
            + sum(t[choice[u]][choice[v]] for (u, v), t in pairs.items()))


def chain_times_s(chain: Chain, choice: dict[str, int]) -> tuple[float, float]:
    """``(gradient seconds in all, seconds the step waits for them)`` for one choice of every group.

    Every block is run stage by stage, as often as it repeats: the closed
    form the ILP uses for repeats is checked against this in the suite. The
    early chain counts ``earlier`` times.
    """
    total = lag = 0.0
    for block in chain.blocks:
        for _ in range(block.repeat):
            for stage in block.stages:
                reduce = stage_value(stage.reduce_nodes, stage.reduce_pairs, choice)
                total += reduce
                lag = reduce + max(0.0, lag - stage_value(stage.before, {}, choice))
    waited = max(0.0, lag - stage_value(chain.after, {}, choice))
    if chain.early is not None:
        early_total, early_waited = chain_times_s(chain.early, choice)
        total, waited = total + chain.earlier * early_total, waited + chain.earlier * early_waited
    return total, waited
