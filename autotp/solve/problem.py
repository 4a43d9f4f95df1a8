"""The planning problem before the solver sees it: groups of ops, their costs, and how choices interact.

One model of a training step (docs/cost-model.md), in pieces the ILP can add up:

* **groups**: one per op, except that identical layers share one
  (`autotp.solve.layers`); per choice, the compute, the collectives inside
  the op's implementation, and the memory it keeps;
* **edges**: a tensor with one use pays its redistribution per pair of
  choices of its producer and consumer (infinite where the pair cannot be);
* **fan-outs**: a tensor with several uses (a norm's output feeding q, k and
  v; a tensor that is also an output) is redistributed once per distinct
  target layout, as the lowering does: each distinct redistribution is an
  *item*, paid once whichever uses need it;
* **the gradient chain** (`autotp.solve.chain`): the gradient sums of
  parameters that the runtime buckets and overlaps with the backward pass,
  and the backward compute that can hide them;
* **the prefetch chain** (`autotp.solve.prefetch`): ZeRO's all-gathers of
  parameters after the optimizer step, and the next forward pass's compute
  that can hide them;
* **collective matmuls** (`autotp.cost.collective_matmul`): what a matmul
  hides of the all-gather into it or the reduce-scatter of its product,
  taken off the pieces above where the use is costed, and kept apart for
  the report (`autotp.solve.tp_overlap`).

Every piece is costed once per distinct op or use and counted as often as it
occurs, so the problem of a deep stack of identical layers costs no more to
build than one layer. `autotp.solve.step` evaluates the same pieces for one
choice; `autotp.solve.ilp` minimises them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from autotp.cost.collective_matmul import Ring, fused_shares, hidden_s, ring
from autotp.cost.comm import DEFAULT_BUCKET_BYTES, gradient_slice_time_s, inner_time_s, optimizer_time_s
from autotp.cost.compute import compute_time_s
from autotp.cost.memory import AUTO, kept_use_bytes, node_memory_bytes, regather_saving, use_traits
from autotp.cost.reshard import edge_cost
from autotp.graph.opgraph import KIND_PARAM, OpGraph
from autotp.placement import R, Shard, local_bytes
from autotp.solve.chain import Chain, build_chain
from autotp.solve.layers import Sharing, share_identical_layers
from autotp.solve.prefetch import build_prefetch
from autotp.solve.recompute import LAYERS, recompute_classes
from autotp.solve.regather import Regather, regather_kind
from autotp.solve.tp_overlap import Hidden
from autotp.solve.working import working_sets
from autotp.strategies.enumerate import OpStrategies
from autotp.strategies.inplace import writes_in_place

OUTPUT = "output"  # the consumer name of a use that returns the tensor from the program
_NOTHING = (0.0, 0)  # a use's regather seconds and freed bytes where it keeps no gathered input
_SITE = "use"  # tags a use's number (`_site_number`) apart from the sides' and tensors' in `_number`


@dataclass
class Group:
    """An op and its twins in identical layers: one choice for all of them, their costs added up."""

    leader: str
    choices: dict[str, list[int]] = field(default_factory=dict)  # member -> strategy index per choice
    cost_s: list[float] = field(default_factory=list)  # exposed time per choice
    memory_bytes: list[int] = field(default_factory=list)  # per device, summed over members
    gradient_bytes: list[int] = field(default_factory=list)  # the gradients among them (`Problem.peak_in_backward`)
    state_bytes: list[int] = field(default_factory=list)  # parameters, gradients, optimizer state and buffers

    @property
    def n(self) -> int:
        return len(self.choices[self.leader])


@dataclass
class Arm:
    """One use of a shared tensor: which of its fan-out's items each pair of choices needs.

    ``consumer`` is the consuming group, or ``None`` for a use whose layout
    follows from the producer's alone (a program output). ``items[i][j]`` is
    the item for producer choice ``i`` and consumer choice ``j`` (``j`` is 0
    without a consumer), or -1 when the use needs nothing.
    """

    consumer: str | None
    items: list[list[int]]


@dataclass
class FanOut:
    """A tensor with several uses: each distinct redistribution (an item) runs, and is paid, once.

    ``ident[k]`` numbers the item's ``(source layout, gradient slices, target
    key)`` within the fan-out: two items with the same ident cost the same and
    are shared alike, which is what dead-end elimination needs to know
    (`autotp.solve.reduce`, which compares them for every model it reduces:
    numbers, where the layouts' tuples cost a hash of every placement each time).
    """

    producer: str  # group
    arms: list[Arm]
    cost_s: list[float]  # per item, already times the number of identical fan-outs
    ident: list[int]
    memory_bytes: list[int] = field(default_factory=list)  # per item: a gathered copy a use keeps for backward


@dataclass
class Problem:
    """Everything the ILP needs, with names that point back at fx nodes."""

    groups: dict[str, Group]
    group_of: dict[str, str]
    edges: dict[tuple[str, str], list[list[float]]]  # exposed seconds per pair of choices; inf: impossible
    strategies: OpStrategies
    # bytes per pair of choices a use keeps for backward (an all-gathered input of a matmul), where any is
    edge_memory: dict[tuple[str, str], list[list[int]]] = field(default_factory=dict)
    fanouts: list[FanOut] = field(default_factory=list)
    chain: Chain | None = None  # None: gradient sums are not overlapped (all their time is exposed)
    prefetch: Chain | None = None  # None: ZeRO's parameter all-gathers are not overlapped (or there are none)
    sharing: Sharing = field(default_factory=Sharing)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    precision: str = AUTO  # the training precision the memory of parameters' state is counted in
    recompute: list = field(default_factory=list)  # layer classes the ILP may recompute (`autotp.solve.recompute`)
    partial_recompute: bool = False  # any number of a class's layers, or all or none (`layer_counts`)
    recomputable: frozenset = frozenset()  # the layers (module paths) of those classes
    micro_batches: int = 1  # forward and backward run this many times a step; gradient sums and the optimizer once
    regather: dict[str, Regather] = field(default_factory=dict)  # kind -> what regathering its uses adds and frees
    tp_overlap: Hidden = field(default_factory=Hidden)  # what collective matmuls hide, already off the costs
    overlap_tp: bool = False  # collective matmuls credited, and run by the lowering (`autotp.cost.collective_matmul`)
    working: dict[str, list[int]] = field(default_factory=dict)  # inference: per group, its ops' largest working set per choice (`autotp.solve.working`)

    @property
    def peak_in_backward(self) -> bool:
        """Whether memory peaks as the larger of two moments rather than as the sum of every term
        (`autotp.solve.step.memory_bytes`): one micro-batch of training, whose gradients are made as backward
        frees the activations; with several, the earlier micro-batches' gradients are held beside the last's
        activations."""
        return self.micro_batches == 1 and any(any(g.gradient_bytes) for g in self.groups.values())

    def strategy(self, node: str, choice: int):
        group = self.groups[self.group_of[node]]
        return self.strategies.by_node[node][group.choices[node][choice]]

    @property
    def overlap_gradients(self) -> bool:
        return self.chain is not None

    def regathering(self, producer) -> Regather:
        """The `Regather` that uses of ``producer``'s output follow (`autotp.solve.regather`)."""
        kind = regather_kind(producer)
        return self.regather.setdefault(kind, Regather(kind))


def arm_item(fanout, arm, choice: dict[str, int]) -> int:
    """The item (or -1) one use of a fan-out needs under ``choice``."""
    row = arm.items[choice[fanout.producer]]
    return row[0] if arm.consumer is None or arm.consumer == fanout.producer else row[choice[arm.consumer]]


def used_items(fanout, choice: dict[str, int]) -> set[int]:
    """The items of a fan-out that ``choice`` runs: each once, whichever uses need it."""
    return {arm_item(fanout, arm, choice) for arm in fanout.arms} - {-1}


def output_layout(src, meta, whole: bool):
    """The layout an output is returned in: split by rows where produced so, else whole; all whole when asked.

    As with DDP, each rank may return its own rows of a batch (dim 0 split
    over an axis stays split); anything else a caller could not read on its
    own (a split of another dim, a partial sum) is made whole on that axis.
    A 0-d output (a loss) is one number on every rank.
    """
    if whole or not meta.shape:
        return (R,) * len(src)
    return tuple(p if isinstance(p, Shard) and p.dim == 0 else R for p in src)


def use_target(graph: OpGraph, mesh, training: bool, whole_outputs: bool, producer: str, consumer: str, i: int,
               src, strategy=None) -> tuple:
    """``(meta, target layout, a gradient flows back, the axes it is summed over)`` of one use.

    The last three are what a redistribution is shared by, in the cost model
    and in the lowering alike: ``src`` is the producer's layout, ``strategy``
    the consumer's (none for an output).
    """
    made_by = graph.node(producer)
    if consumer == OUTPUT:
        meta = made_by.out[0]
        return meta, output_layout(src, meta, whole_outputs), training and made_by.requires_grad and meta.is_float, ()
    op = graph.node(consumer)
    meta = op.in_metas[i]
    grad = training and op.requires_grad and made_by.requires_grad and meta.is_float
    axes = tuple(a for a in strategy.grad_allreduce_axes(i) if mesh.shape[a] > 1) if grad else ()
    return meta, strategy.ins[i], grad, axes


def split_gradient_axes(split: tuple, src, dst, grad: bool, axes: tuple) -> tuple | None:
    """The axes a use's gradient is still all-reduced over when ZeRO-2 reduce-scatters it over ``split``.

    ``split`` is the parameter's optimizer axes when its gradient goes straight
    into their slices (``Strategy.gradient_split``), else empty (``axes`` is
    returned as it is). The reduce-scatter sums over ``split`` as it slices,
    so the use must sum its gradient over every axis of ``split``, and take
    the parameter as it is laid out (nothing forward): otherwise ``None``,
    this pair cannot be.

        split (0,), gradient summed over (0, 1) -> all-reduce over (1,), then reduce-scatter over 0
    """
    if not split:
        return axes
    if not grad or tuple(src) != tuple(dst) or not set(split) <= set(axes):
        return None
    return tuple(a for a in axes if a not in split)


def uses_of(graph: OpGraph) -> dict[str, list[tuple[str, int]]]:
    """Every use of every tensor, in program order: ``(consumer, input index)``, ``("output", k)`` when returned."""
    uses = {name: [] for name in graph.order}
    for op in graph.nodes():
        for i, producer in enumerate(op.inputs):
            uses[producer].append((op.name, i))
    for k, name in enumerate(graph.outputs):
        uses[name].append((OUTPUT, k))
    return uses


def deferred_parameters(graph: OpGraph, uses: dict) -> set[str]:
    """Parameters whose gradient the runtime can bucket: differentiated, with exactly one use.

    A tied weight's gradient sums its uses, so it is not any single edge's
    partial sum; it is reduced where it is used, as every other collective is.
    """
    return {op.name for op in graph.nodes() if op.kind == KIND_PARAM and op.requires_grad
            and len(uses[op.name]) == 1 and uses[op.name][0][0] != OUTPUT}


def build_problem(graph: OpGraph, strategies: OpStrategies, mesh, profile, training: bool,
                  overlap_gradients: bool = True, share_layers: bool = True, whole_outputs: bool = False,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: str = AUTO,
                  recompute: bool | str = True, micro_batches: int = 1, overlap_tp: bool = True) -> Problem:
    """Cost every group choice, every use of every tensor, and (when overlapped) the gradient chain.

    With ``overlap_gradients`` (and ``training``) the gradient sums of
    parameters with one use go to the chain, at the bucket's rates, and
    ZeRO's all-gathers after the optimizer step to the prefetch chain;
    otherwise they are exposed like every other collective. ``whole_outputs`` returns
    every output replicated (R); by default an output split by rows stays so
    and anything else is made whole (`output_layout`). With ``share_layers``
    identical layers share their choices (`autotp.solve.layers`). ``precision`` is the training precision
    of the parameters' state (`autotp.cost.memory`); with ``recompute`` (and
    ``training``) classes of identical layers may be recomputed in backward
    (`autotp.solve.recompute`), whole or, with ``"layers"``, any number of
    their layers. ``graph`` is one of ``micro_batches``
    micro-batches of a step: its compute and collectives run that many
    times, the bucketed gradient sums (behind the last micro-batch's backward)
    and what follows the optimizer step once. With ``overlap_tp`` an
    all-gather into a matmul, or a reduce-scatter of its product, runs as a
    collective matmul and is credited what the matmul hides
    (`autotp.cost.collective_matmul`).
    """
    groups = {op.name: Group(op.name, {op.name: list(range(len(strategies.by_node[op.name])))})
              for op in graph.nodes()}
    group_of = {name: name for name in groups}
    sharing = share_identical_layers(graph, strategies, groups, group_of) if share_layers else Sharing()
    problem = Problem(groups, group_of, {}, strategies, sharing=sharing, bucket_bytes=bucket_bytes,
                      precision=precision, micro_batches=micro_batches, overlap_tp=overlap_tp)
    for group in groups.values():
        group.cost_s, group.memory_bytes = [0.0] * group.n, [0] * group.n
        group.gradient_bytes, group.state_bytes = [0] * group.n, [0] * group.n
    uses = uses_of(graph)
    deferred = deferred_parameters(graph, uses) if training and overlap_gradients else set()
    coster = _Coster(problem, graph, mesh, profile, training, whole_outputs, deferred, overlap_gradients, precision)
    for (leader, name), count in Counter((group_of[op.name], sharing.of(op.name)) for op in graph.nodes()).items():
        coster.add_node(groups[leader], graph.node(name), count)
    canonical = Counter((sharing.of(p), tuple((sharing.of(v) if v != OUTPUT else v, i) for v, i in u))
                        for p, u in uses.items() if u)
    if training and recompute:  # before the uses: what enters a layer that may be recomputed is kept
        problem.recompute = recompute_classes(graph, problem, mesh, profile, precision)
        problem.partial_recompute = recompute == LAYERS
        problem.recomputable = frozenset(layer for rc in problem.recompute for layer in rc.layers)
    for (producer, arms), count in canonical.items():
        coster.add_uses(producer, list(arms), count, micro_batches)
    problem.regather = {kind: r for kind, r in problem.regather.items() if training and (r.groups or r.edges or r.items)}
    if not training:  # an inference program peaks at its largest working set beside its state
        problem.working = working_sets(graph, problem, mesh)
    if training and overlap_gradients:
        problem.chain = build_chain(graph, problem, deferred, coster.gradient_table, mesh, profile, training,
                                    micro_batches)
        problem.prefetch = build_prefetch(graph, problem, mesh, profile)
    return problem


@dataclass
class _Coster:
    """Adds costs into a `Problem`; the same redistribution of the same tensor is costed once."""

    problem: Problem
    graph: OpGraph
    mesh: object
    profile: object
    training: bool
    whole_outputs: bool
    deferred: set
    overlap: bool
    precision: str = AUTO
    memo: dict = field(default_factory=dict)
    as_made: dict = field(default_factory=dict)  # per use (`_taken_as_made`)
    tables: dict = field(default_factory=dict)  # gradient tables of deferred uses, by twin
    sides: dict = field(default_factory=dict)  # per use: `_shared`'s numbers of each side's choices, and its pairs
    made_as: dict = field(default_factory=dict)  # per producer: the number of each choice's side (`_shared`)
    tensor_of: dict = field(default_factory=dict)  # per use: the numbers of its tensor and of itself (`_shared`)
    priced: dict = field(default_factory=dict)  # numbers of both sides, the tensor and the use -> `_priced`
    names: dict = field(default_factory=dict)  # a side or a tensor -> its number (`_number`)

    def add_node(self, group: Group, op, count: int) -> None:
        """``count`` ops alike to ``op``: their compute, inner collectives and memory, per group choice."""
        for c in range(group.n):
            strategy = self.problem.strategy(op.name, c)
            if strategy.gradient_split and op.name not in self.deferred:
                group.cost_s[c] = math.inf  # its gradient is summed in the program, not in the reducer's buckets
            per_micro_batch = (compute_time_s(op, strategy, self.mesh, self.profile, self.training)
                               + inner_time_s(op, strategy, self.mesh, self.profile, self.training))
            group.cost_s[c] += count * (self.problem.micro_batches * per_micro_batch
                                        + (0.0 if self.prefetched(op) else optimizer_time_s(op, strategy, self.mesh,
                                                                                           self.profile)))
            terms = node_memory_bytes(op, strategy, self.mesh, self.training, self.precision)
            group.memory_bytes[c] += count * sum(terms.values())
            group.gradient_bytes[c] += count * terms.get("gradients", 0)
            group.state_bytes[c] += count * sum(v for term, v in terms.items() if term != "activations")

    def prefetched(self, op) -> bool:
        """Whether ``op``'s all-gather after the optimizer step goes to the prefetch chain (`build_prefetch`)."""
        return self.training and self.overlap and bool(self.graph.consumers(op.name))

    def use(self, producer: str, consumer: str, i: int, cu: int, cv: int, sole: bool = False) -> tuple:
        """``(target key, exposed, gradient, kept, regather, ring)`` of one use for one pair of choices.

        The key is a number (`_number`) for what the lowering shares a redistribution by (`use_target`).
        ``None`` with infinite time: the pair cannot be (the pieces of a split
        are taken as produced, and so is a tensor an op writes in place). ``kept``: the bytes the redistribution leaves
        alive until backward (`kept_use_bytes`: a sum's result, an all-gathered
        input the consumer's backward reads). ``regather``: the seconds and the
        bytes freed if that gathered input is gathered again in backward instead
        (`autotp.solve.regather`), ``(0.0, 0)`` where nothing is kept. ``ring``: the collective matmul
        that can hide part of ``exposed`` (and of ``regather``'s seconds), or None
        (`autotp.cost.collective_matmul`; ``sole``: the producer's output has no other use); what it hides
        is still in both.
        """
        made = self.problem.strategy(producer, cu)
        strategy = None if consumer == OUTPUT else self.problem.strategy(consumer, cv)
        if consumer == OUTPUT:  # the target follows the source (`output_layout`): nothing to share by
            key, exposed, gradient, kept, regather, lone = self._use(producer, consumer, i, made, strategy)
        else:
            key, exposed, gradient, kept, regather, lone = self._shared(producer, consumer, i, cu, cv, made, strategy)
        served = None
        if lone is not None and self.problem.overlap_tp:
            user = None if consumer == OUTPUT else self.graph.node(consumer)
            served = ring(lone, self.graph.node(producer), made, user, strategy, i, sole, self.mesh, self.profile,
                          self.training)
        return key, exposed, gradient, kept, regather, served

    def _shared(self, producer: str, consumer: str, i: int, cu: int, cv: int, made, strategy) -> tuple:
        """`_use` of a pair, computed once per use for each pair of what it depends on: the producer's layout and
        gradient slices, the consumer's layout and gradient sums (at batch 8, 59,000 distinct of the 97,000 pairs, each
        of which took a hash of every placement of both layouts, and of the tensor's shape, to find it)."""
        site = producer, consumer, i
        sides = self.sides.get(site)
        if sides is None:
            sides = self.sides[site] = self.made_as.setdefault(producer, {}), {}, {}
        by_made, by_taken, by_pair = sides
        if cu not in by_made:
            by_made[cu] = self._made_number(made)
        if cv not in by_taken:
            target = use_target(self.graph, self.mesh, self.training, self.whole_outputs, producer, consumer, i,
                                None, strategy)
            by_taken[cv] = self._number(target[1:]), target
            if site not in self.tensor_of:  # the tensor, and what pricing reads of the use: the same for every pair
                self.tensor_of[site] = self._tensor_number(producer, target), self._site_number(producer, consumer, i)
        taken, target = by_taken[cv]
        pair = by_made[cu], taken
        if pair not in by_pair:
            by_pair[pair] = self._priced(producer, consumer, i, made, target, (*pair, *self.tensor_of[site]))
        return by_pair[pair]

    def _number(self, side: tuple) -> int:
        """``side``'s number among every side and tensor costed (`_shared`): a dict key that hashes at once."""
        return self.names.setdefault(side, len(self.names))

    def _made_number(self, made) -> int:
        """The number of a producer's side: its strategy's layout and gradient slices."""
        return self._number((made.out, made.gradient_slice_axes))

    def _tensor_number(self, producer: str, target: tuple) -> int:
        """The number of a use's tensor (``target``'s meta, `use_target`) and whether its gradient is bucketed."""
        return self._number((target[0], producer in self.deferred))

    def _site_number(self, producer: str, consumer: str, i: int) -> int:
        """The number of what `_priced` reads of a use beside its two sides and its tensor: whether it must take
        the tensor as made (`_taken_as_made`), and its ops' `use_traits`. Uses alike in it, in their sides and
        in their tensor are priced alike: at batch 8, 59,000 pairs of uses are priced as 21,800."""
        user = None if consumer == OUTPUT else self.graph.node(consumer)
        traits = use_traits(self.graph.node(producer), user, i, self.problem.recomputable)
        return self._number((_SITE, self._taken_as_made(producer, consumer, i), traits))

    def _use(self, producer: str, consumer: str, i: int, made, strategy) -> tuple:
        """`use` with ``lone`` (`edge_cost`'s lone collective, or None) in the place of the ring."""
        target = use_target(self.graph, self.mesh, self.training, self.whole_outputs, producer, consumer, i,
                            made.out, strategy)
        numbers = (self._made_number(made), self._number(target[1:]), self._tensor_number(producer, target),
                   self._site_number(producer, consumer, i))
        return self._priced(producer, consumer, i, made, target, numbers)

    def _priced(self, producer: str, consumer: str, i: int, made, target: tuple, numbers: tuple) -> tuple:
        """`_use` of the producer's strategy ``made`` and the use's ``target`` (`use_target`); ``numbers``: of both
        sides, of the tensor and of the use (`_site_number`), what it is priced once by."""
        if numbers not in self.priced:
            self.priced[numbers] = self._price(producer, consumer, i, made, target, numbers[:3])
        return self.priced[numbers]

    def _price(self, producer: str, consumer: str, i: int, made, target: tuple, numbers: tuple) -> tuple:
        """`_priced`, computed: ``numbers`` of both sides and of the tensor are what its redistribution is costed
        once by."""
        src = made.out
        meta, dst, grad, axes = target
        if src != dst and self._taken_as_made(producer, consumer, i):
            return None, math.inf, 0.0, 0, _NOTHING, None  # pieces of a split, or a tensor written in place
        split = made.gradient_slice_axes
        summed = split_gradient_axes(split, src, dst, grad, axes)
        if summed is None:
            return None, math.inf, 0.0, 0, _NOTHING, None
        deferred = producer in self.deferred
        if numbers not in self.memo:
            exposed, gradient, gathers, again, lone = edge_cost(src, dst, meta, self.mesh, self.profile,
                                                                self.training, grad, summed, deferred,
                                                                self.problem.bucket_bytes)
            if split:
                gradient += gradient_slice_time_s(split, local_bytes(meta, src, self.mesh.shape), self.mesh,
                                                  self.profile, self.problem.bucket_bytes)
            self.memo[numbers] = exposed, gradient, gathers, again, lone
        exposed, gradient, gathers, again, lone = self.memo[numbers]
        user, made_by = None if consumer == OUTPUT else self.graph.node(consumer), self.graph.node(producer)
        kept = kept_use_bytes(made_by, user, i, src, dst, meta, self.mesh, self.training, gathers,
                              self.problem.recomputable)
        freed = regather_saving(made_by, src, meta, self.mesh, kept, gathers)
        return numbers[1], exposed, gradient, kept, (again, freed) if freed else _NOTHING, lone

    def _taken_as_made(self, producer: str, consumer: str, i: int) -> bool:
        """Whether this use must take the tensor in the layout it is made in: a piece of a split, or the
        tensor an op writes in place (asked once per use, not per pair of choices)."""
        site = producer, consumer, i
        if site not in self.as_made:
            self.as_made[site] = consumer != OUTPUT and (self.graph.node(producer).multi_output or (
                i == 0 and writes_in_place(self.graph.node(consumer))))
        return self.as_made[site]

    def gradient_table(self, producer: str, consumer: str, i: int) -> list[list[float]]:
        """The gradient seconds of a deferred use, per pair of choices of its two groups.

        Twins in identical layers share their choices and strategies, so their
        uses share one table (80 layers cost what one does).
        """
        key = (self.problem.sharing.of(producer), self.problem.sharing.of(consumer), i)
        if key not in self.tables:
            gu, gv = self.problem.group_of[producer], self.problem.group_of[consumer]
            nu, nv = self.problem.groups[gu].n, self.problem.groups[gv].n
            self.tables[key] = [[self.use(producer, consumer, i, cu, cv)[2] for cv in range(nv)] for cu in range(nu)]
        return self.tables[key]

    def add_uses(self, producer: str, arms: list[tuple[str, int]], count: int, runs: int = 1) -> None:
        """``count`` tensors alike to ``producer`` with these uses: an edge when one, else a fan-out.

        Their collectives run ``runs`` times a step (once per micro-batch); a
        gathered input kept for backward is one buffer whatever ``runs`` is,
        since each micro-batch's backward frees its own.
        """
        if len(arms) == 1 and arms[0][0] != OUTPUT:
            self.add_edge(producer, *arms[0], count, runs)
            return
        gu = self.problem.group_of[producer]
        fanout = FanOut(gu, [], [], [])
        f = len(self.problem.fanouts)
        regather = self.problem.regathering(self.graph.node(producer))
        index: dict[tuple, int] = {}
        idents: dict[tuple, int] = {}  # numbers of (source layout and gradient slices, target key) -> `FanOut.ident`
        rings: dict[int, dict[int, list]] = {}  # per item, per use: (consumer, cu, cv, ring) of each pair needing it
        plain: set[int] = set()  # items a use of which no collective matmul serves: the lowering may fuse none
        again_of: dict[int, float] = {}
        for a, (consumer, i) in enumerate(arms):
            gv = None if consumer == OUTPUT else self.problem.group_of[consumer]
            nv = 1 if gv is None or gv == gu else self.problem.groups[gv].n
            items = []
            for cu in range(self.problem.groups[gu].n):
                row = []
                for cv in ([cu] if gv == gu else range(nv)):
                    key, exposed, _, kept, (again, freed), served = self.use(producer, consumer, i, cu, cv)
                    if math.isinf(exposed):
                        self._forbid(gu, gv, cu, cv)
                    if key is None or exposed == 0:
                        row.append(-1)
                        continue
                    if (cu, key) not in index:
                        index[cu, key] = len(fanout.cost_s)
                        fanout.cost_s.append(count * runs * exposed)
                        made = self.problem.strategy(producer, cu)
                        made_as = self._made_number(made)
                        fanout.ident.append(idents.setdefault((made_as, key), len(idents)))
                        fanout.memory_bytes.append(0)
                    k = index[cu, key]
                    if served is None:
                        plain.add(k)
                    else:
                        rings.setdefault(k, {}).setdefault(a, []).append((gv, cu, cv, served))
                    # one buffer, kept if any use that may share it keeps it
                    fanout.memory_bytes[k] = max(fanout.memory_bytes[k], count * kept)
                    if freed:
                        regather.add_item(f, k, count * runs * again, count * freed)
                        again_of[k] = max(again_of.get(k, 0.0), again)
                    row.append(k)
                items.append(row)
            fanout.arms.append(Arm(gv, items))
            if gv is not None and gv != gu and self.problem.groups[gu].n > 1 and nv > 1:
                self._table(gu, gv)  # the pair variables that link the item to both choices
        if fanout.cost_s:
            for k, by_use in rings.items():
                if k not in plain:
                    self._credit_fused(gu, regather, by_use, again_of.get(k, 0.0), count * runs)
            self.problem.fanouts.append(fanout)

    @staticmethod
    def _credited(use: tuple) -> tuple:
        """A use's tuple with its ring replaced by ``(hidden, regather hidden)`` (`hidden_s`)."""
        return (*use[:5], hidden_s(use[5], use[4][0]))

    def _credit_fused(self, gu: str, regather, by_use: dict[int, list], again: float, times: int) -> None:
        """Credit one fan-out item's ring use by use (`fused_shares`): each pair of choices that needs the
        gather is credited its matmul's share, on the piece the pair lives on (its producer's or consumer's
        choice, or the edge's pair: as `_use_indicator` in `autotp.solve.ilp` reads it)."""
        widest = [Ring(uses[0][3].forward, max(u[3].ahead for u in uses), uses[0][3].backward,
                       max(u[3].behind for u in uses), True) for uses in by_use.values()]
        ahead, behind, again_behind = fused_shares(widest, again)
        groups, hidden = self.problem.groups, self.problem.tp_overlap
        for uses in by_use.values():
            for gv, cu, cv, served in uses:
                seconds = times * (served.ahead * ahead + served.behind * behind)
                extra = times * served.behind * (again_behind - behind)
                by_producer = gv is None or gv == gu or groups[gv].n == 1
                if by_producer or groups[gu].n == 1:
                    target, c = (groups[gu], cu) if by_producer else (groups[gv], cv)
                    target.cost_s[c] -= seconds
                    hidden.add_group(target, c, seconds)
                    if extra:
                        regather.add_group(target, c, -extra, 0)
                else:
                    self._table(gu, gv)[cu][cv] -= seconds
                    hidden.add_pair(gu, gv, groups[gu].n, groups[gv].n, cu, cv, seconds)
                    if extra:
                        regather.add_pair(gu, gv, groups[gu].n, groups[gv].n, cu, cv, -extra, 0)

    def _table(self, gu: str, gv: str) -> list[list[float]]:
        edges = self.problem.edges
        if (gu, gv) not in edges:
            edges[gu, gv] = [[0.0] * self.problem.groups[gv].n for _ in range(self.problem.groups[gu].n)]
        return edges[gu, gv]

    def _forbid(self, gu: str, gv: str | None, cu: int, cv: int) -> None:
        """Pair ``(cu, cv)`` cannot be: infinite on the edge, or on the choice of the side that has one."""
        groups = self.problem.groups
        if gv is None or gv == gu or groups[gv].n == 1:
            groups[gu].cost_s[cu] = math.inf
        elif groups[gu].n == 1:
            groups[gv].cost_s[cv] = math.inf
        else:
            self._table(gu, gv)[cu][cv] = math.inf

    def add_edge(self, producer: str, consumer: str, i: int, count: int, runs: int = 1) -> None:
        """``count`` single uses alike to ``producer -> consumer`` (input ``i``): exposed seconds per pair, run
        ``runs`` times a step, and the bytes a use keeps for backward (once)."""
        groups = self.problem.groups
        gu, gv = self.problem.group_of[producer], self.problem.group_of[consumer]
        nu, nv = groups[gu].n, groups[gv].n
        regather = self.problem.regathering(self.graph.node(producer))
        hidden = self.problem.tp_overlap
        if gu == gv:  # both ends are fixed by the same choice
            for c in range(nu):
                _, exposed, _, kept, (again, freed), served = self.use(producer, consumer, i, c, c, sole=True)
                overlap, hides = hidden_s(served, again)
                groups[gu].cost_s[c] += count * runs * (exposed - overlap)
                groups[gu].memory_bytes[c] += count * kept
                hidden.add_group(groups[gu], c, count * runs * overlap)
                if freed:
                    regather.add_group(groups[gu], c, count * runs * (again - hides), count * freed)
            return
        pairs = [[self._credited(self.use(producer, consumer, i, cu, cv, sole=True)) for cv in range(nv)]
                 for cu in range(nu)]
        if nu == 1 or nv == 1:  # fold into the side that has a choice
            for cu in range(nu):
                for cv in range(nv):
                    target, c = (groups[gv], cv) if nu == 1 else (groups[gu], cu)
                    overlap, hides = pairs[cu][cv][5]
                    target.cost_s[c] += count * runs * (pairs[cu][cv][1] - overlap)
                    target.memory_bytes[c] += count * pairs[cu][cv][3]
                    hidden.add_group(target, c, count * runs * overlap)
                    again, freed = pairs[cu][cv][4]
                    if freed:
                        regather.add_group(target, c, count * runs * (again - hides), count * freed)
            return
        table = self._table(gu, gv)
        for cu in range(nu):
            for cv in range(nv):
                table[cu][cv] += count * runs * (pairs[cu][cv][1] - pairs[cu][cv][5][0])
                hidden.add_pair(gu, gv, nu, nv, cu, cv, count * runs * pairs[cu][cv][5][0])
        if any(use[3] for row in pairs for use in row):
            memory = self.problem.edge_memory.setdefault((gu, gv), [[0] * nv for _ in range(nu)])
            for cu in range(nu):
                for cv in range(nv):
                    memory[cu][cv] += count * pairs[cu][cv][3]
                    again, freed = pairs[cu][cv][4]
                    if freed:
                        regather.add_pair(gu, gv, nu, nv, cu, cv, count * runs * (again - pairs[cu][cv][5][1]),
                                          count * freed)
