"""The ILP finds the best plan of its own problem, and dead-end elimination never loses it: checked by enumeration.

Small random problems carry every piece of the step model (`autotp.solve.problem`):
choices with infinite costs, edge tables with impossible pairs and pairs
credited below zero (a fused ring's share), fan-outs whose
items are paid once however many uses need them (uses inside one group, uses
with no consumer, uses from single-choice groups), memory kept on edges and
fan-out items (gathered inputs kept for backward), at times gradients and
the model's state per choice (the peak the larger of backward's start and
end: `autotp.solve.step.memory_bytes`), a gradient chain with
repeated blocks (`autotp.solve.chain`) and, at times, the early chain that
micro-batches before the last run for ZeRO-2's sliced gradients, a prefetch chain of ZeRO's
all-gathers (`autotp.solve.prefetch`), and layer classes that may be
recomputed (`autotp.solve.recompute`: forward seconds again, bytes freed,
one layer's transient), and kinds of gathered inputs that may be gathered
again in backward (`autotp.solve.regather`: seconds added and bytes freed
on groups, edge pairs and fan-out items, and seconds alone on pairs that
keep nothing), and, without the gradients, an inference program's largest
working set of one group (`autotp.solve.working`). Values come from a few levels, so
ties abound. Every plan, each class recomputed or not, each kind regathered
or not, is enumerated and priced by `autotp.solve.step`:

* the ILP's optimum, with and without the reduction, is the best plan's time,
  free and under a binding memory limit, and the least memory when minimised;
  asked to beat the limited optimum (a plan found elsewhere), it says no
  plan under the limit does, though one without it would;
* binaries fixed by the relaxations' reduced costs, and the first branch
  cut off at the plan rounded from its relaxation, keep the limited optimum;
* the proof that a branch cannot fit (its least-memory relaxation over the
  limit), asked of every relaxation of 20 problems, keeps the optimum, and
  no branch it rules out holds a plan that fits;
* the best plan the reduction leaves (of each problem with a set of kinds
  regathered, as the solver tries them) is the best plan of all, and so is
  the best one agreeing with a protected partial plan (the warm start).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from autotp.errors import SolverError
from autotp.solve.chain import Block, Chain, Stage, chain_times_s
from autotp.solve.ilp import _BYTES, MemoryInfeasible, NoBetterPlan, solve
from autotp.solve.prefetch import prefetch_times_s
from autotp.solve.problem import Arm, FanOut, Group, Problem
from autotp.solve.recompute import Recompute
from autotp.solve.regather import KINDS, Regather, families, family, folded, kind_sets, least_of_sets, split_kind
from autotp.solve.reduce import reduce_problem
from autotp.solve.step import memory_bytes, step_time


def _level(rng):
    return rng.choice([0.0, 1.0, 1.0, 2.0, 3.0])


def _credit(rng):
    """What a collective matmul takes off a pair of choices (a fused ring's share): at times more than the pair
    costs itself, since the gather it hides is paid on a fan-out's item."""
    return rng.choice([0.0, 0.0, 0.0, 0.5, 1.5])


def _random_problem(rng: random.Random) -> Problem:
    """5 to 6 groups of 1 to 4 choices (memory in MiB, the ILP's unit) on a random graph, with fan-outs and (often) a gradient chain."""
    names = [f"g{i}" for i in range(rng.randint(5, 6))]
    groups = {}
    for name in names:
        n = rng.choice([1, 2, 2, 3, 4])
        cost = [_level(rng) if rng.random() > 0.1 else math.inf for _ in range(n)]
        if all(math.isinf(c) for c in cost):
            cost[0] = 0.0
        groups[name] = Group(name, {name: list(range(n))}, cost, [rng.choice([1, 2, 2, 4]) * _BYTES for _ in range(n)])
    edges = {}
    for u, v in itertools.permutations(names, 2):  # both directions at times: groups can feed each other
        if groups[u].n > 1 and groups[v].n > 1 and rng.random() < (0.4 if u < v else 0.1):
            edges[u, v] = [[_level(rng) - _credit(rng) if rng.random() > 0.15 else math.inf
                            for _ in range(groups[v].n)] for _ in range(groups[u].n)]
    problem = Problem(groups, {name: name for name in names}, edges, None)
    if rng.random() < 0.5:  # one micro-batch of training: the peak is the larger of backward's start and end
        for group in groups.values():
            group.gradient_bytes = [rng.choice([0, 0, 1]) * _BYTES for _ in range(group.n)]
            group.state_bytes = [min(m, g + rng.choice([0, 1, 2]) * _BYTES)
                                 for m, g in zip(group.memory_bytes, group.gradient_bytes)]
    for e in edges:  # a use that gathers its input and keeps it for backward holds memory per pair
        if rng.random() < 0.3:
            problem.edge_memory[e] = [[rng.choice([0, 1, 2]) * _BYTES for _ in row] for row in edges[e]]
    for _ in range(rng.randint(0, 3)):
        problem.fanouts.append(_random_fanout(rng, problem))
    if rng.random() < 0.7:
        problem.chain = _random_chain(rng, problem)
        if rng.random() < 0.4:  # micro-batches before the last sum the sliced gradients: a chain paid that often
            problem.chain.early, problem.chain.earlier = _random_chain(rng, problem), rng.choice([1, 3])
    if rng.random() < 0.5:
        problem.prefetch = _random_chain(rng, problem, pairs=False, after=False)
    if rng.random() < 0.5:
        problem.recompute = [_random_recompute(rng, problem) for _ in range(rng.randint(1, 2))]
        problem.partial_recompute = rng.random() < 0.5
    if rng.random() < 0.5:
        _random_regather(rng, problem, rng.sample(KINDS, rng.randint(1, 2)))
    if not problem.peak_in_backward and rng.random() < 0.5:  # inference: the largest working set of one group
        problem.working = {g: [rng.choice([0, 1, 2, 3]) * _BYTES for _ in range(problem.groups[g].n)]
                           for g in rng.sample(list(problem.groups), rng.randint(1, 3))}
    return problem


def _random_regather(rng, problem: Problem, kinds) -> None:
    """Seconds added and bytes freed (never more than is kept there) on a few groups, edges and fan-out items,
    each piece of one kind (as in a real problem, where the producer's kind is its uses')."""
    problem.regather = {kind: Regather(kind) for kind in kinds}
    pick = lambda: problem.regather[rng.choice(kinds)]
    for g in rng.sample(list(problem.groups), rng.randint(0, 2)):
        group = problem.groups[g]
        pick().groups[g] = ([_level(rng) for _ in range(group.n)], [rng.choice([0, 1]) * m for m in group.memory_bytes])
    for e in rng.sample(list(problem.edge_memory), min(len(problem.edge_memory), rng.randint(0, 2))):
        kept = problem.edge_memory[e]
        pick().edges[e] = ([[_level(rng) for _ in row] for row in kept], [[rng.choice([0, m]) for m in row] for row in kept])
    bare = sorted(set(problem.edges) - set(problem.edge_memory))
    for e in rng.sample(bare, min(len(bare), rng.randint(0, 1))):
        # seconds alone on a pair that keeps nothing (a fused ring's regather, net of its credit, where the pair's
        # use needs the item that keeps the gathered input)
        table = problem.edges[e]
        pick().edges[e] = ([[_level(rng) for _ in row] for row in table], [[0] * len(row) for row in table])
    for f, fanout in enumerate(problem.fanouts):
        r, by_ident = pick(), {}  # items with one ident are one redistribution: they regather alike
        for k, ident in enumerate(fanout.ident):
            if fanout.memory_bytes and fanout.memory_bytes[k] and rng.random() < 0.5:
                r.items[f, k] = by_ident.setdefault(ident, (_level(rng), fanout.memory_bytes[k]))


def _random_recompute(rng, problem: Problem) -> Recompute:
    """A class of 1 to 3 layers: forward seconds and freed bytes per choice of a few groups (whole MiB a layer)."""
    count = rng.randint(1, 3)
    rc = Recompute([f"layers.{i}" for i in range(count)])
    for g in rng.sample(list(problem.groups), rng.randint(1, 2)):
        rc.forward_s[g] = [_level(rng) for _ in range(problem.groups[g].n)]
    for g in rng.sample(list(problem.groups), rng.randint(1, 2)):
        rc.saved_bytes[g] = [rng.choice([0, 1, 2]) * count * _BYTES for _ in range(problem.groups[g].n)]
    return rc


def _random_fanout(rng, problem: Problem) -> FanOut:
    names = list(problem.groups)
    producer = rng.choice(names)
    nu = problem.groups[producer].n
    keys = rng.randint(1, 3)  # target layouts the uses may ask for
    fanout = FanOut(producer, [], [], [])
    index, numbers = {}, {}
    for _ in range(rng.randint(2, 3)):
        consumer = rng.choice(names + [None])
        if consumer not in (None, producer) and problem.groups[consumer].n > 1 and nu > 1:
            problem.edges.setdefault((producer, consumer), [[0.0] * problem.groups[consumer].n for _ in range(nu)])
        width = 1 if consumer in (None, producer) else problem.groups[consumer].n
        items = []
        for i in range(nu):
            row = []
            for _ in range(width):
                key = rng.randrange(keys + 1)  # keys: 0 is "nothing to run"
                if key == 0:
                    row.append(-1)
                    continue
                if (i, key) not in index:
                    index[i, key] = len(fanout.cost_s)
                    fanout.cost_s.append(rng.choice([1.0, 2.0, 3.0]))
                    # producer choices may share a source layout: items of one (layout, key) share their number
                    fanout.ident.append(numbers.setdefault((rng.randrange(2), key), len(numbers)))
                row.append(index[i, key])
            items.append(row)
        fanout.arms.append(Arm(consumer, items))
    # items with one ident must cost alike: the reduction relies on it, as the real problem guarantees
    if rng.random() < 0.5:  # some items are gathered inputs their uses keep for backward
        fanout.memory_bytes = [rng.choice([0, 1, 2]) * _BYTES for _ in fanout.cost_s]
    by_ident, kept = {}, {}
    for k, ident in enumerate(fanout.ident):
        fanout.cost_s[k] = by_ident.setdefault(ident, fanout.cost_s[k])
        if fanout.memory_bytes:
            fanout.memory_bytes[k] = kept.setdefault(ident, fanout.memory_bytes[k])
    return fanout


def _terms(rng, problem: Problem, pairs: bool):
    nodes, tables = {}, {}
    for g in rng.sample(list(problem.groups), rng.randint(1, 2)):
        nodes[g] = [_level(rng) for _ in range(problem.groups[g].n)]
    if pairs and problem.edges and rng.random() < 0.5:
        e = rng.choice(list(problem.edges))
        tables[e] = [[_level(rng) for _ in range(problem.groups[e[1]].n)] for _ in range(problem.groups[e[0]].n)]
    return nodes, tables


def _random_chain(rng, problem: Problem, pairs: bool = True, after: bool = True) -> Chain:
    """A gradient chain, or (no pair terms, nothing after) a prefetch chain of ZeRO's all-gathers."""
    blocks = []
    for _ in range(rng.randint(1, 3)):
        stages = []
        for _ in range(rng.randint(1, 2)):
            reduce_nodes, reduce_pairs = _terms(rng, problem, pairs=pairs)
            before, _ = _terms(rng, problem, pairs=False)
            stages.append(Stage(0, reduce_nodes, reduce_pairs, before))
        blocks.append(Block(stages, rng.choice([1, 1, 2, 3])))
    return Chain(blocks, _terms(rng, problem, pairs=False)[0] if after else {})


def _plans(problem: Problem, reduction=None, recompute: bool = True):
    """Every possible plan the reduction leaves (all when ``None``): ``(choice, time, memory)``.

    Each layer class recomputed whole or not, or any number of its layers with ``partial_recompute``, and each
    kind regathered or not (the ILP has those choices when memory counts, ``recompute``).
    """
    names = list(problem.groups)
    subsets, kinds = [()], [()]
    if recompute:
        options = [range(rc.count + 1) if problem.partial_recompute else (0, rc.count) for rc in problem.recompute]
        subsets = [tuple(enumerate(counts)) for counts in itertools.product(*options)]
        kinds = [k for n in range(len(problem.regather) + 1) for k in itertools.combinations(problem.regather, n)]
    for picks in itertools.product(*(range(problem.groups[g].n) for g in names)):
        choice = dict(zip(names, picks))
        if reduction and (any(choice[g] not in reduction.choices[g] for g in names)
                          or any(not reduction.pairs[u, v][choice[u], choice[v]] for u, v in problem.edges)):
            continue
        for recomputed, regathered in itertools.product(subsets, kinds):
            total = step_time(problem, choice, recomputed, regathered).total_s
            if not math.isinf(total):
                yield choice, total, memory_bytes(problem, choice, recomputed, regathered)


def _solvable(seeds):
    """``(seed, problem, every plan, their distinct memories sorted)`` of each seed's random problem that has a plan."""
    for seed in seeds:
        problem = _random_problem(random.Random(seed))
        every = list(_plans(problem))
        if every:
            yield seed, problem, every, sorted({m for _, _, m in every})


def _best(plans, limit=None, by="time"):
    values = [(t, m) if by == "time" else (m, t) for _, t, m in plans if limit is None or m <= limit]
    return min(values)[0] if values else None


@pytest.mark.parametrize("seed", range(80))
def test_the_ilp_and_the_reduction_keep_the_best_plan_of_every_random_problem(seed):
    rng = random.Random(seed)
    problem = _random_problem(rng)
    every = list(_plans(problem))
    if not every:
        with pytest.raises(SolverError):
            solve(problem)
        return
    memories = sorted({m for _, _, m in every})
    limit = memories[len(memories) // 3]  # binding: the fastest plans do not fit
    for reduce in (True, False):
        assert solve(problem, reduce=reduce).objective_s == pytest.approx(_best(every), abs=1e-9), (seed, reduce)
        assert solve(problem, memory_limit_bytes=limit, reduce=reduce).objective_s == pytest.approx(
            _best(every, limit), abs=1e-9), (seed, reduce)
        free, limited = _best(every), _best(every, limit)
        # each outcome alike where the bound without the limit is skipped (`solve(unlimited_bound=False)`)
        for bound in (True, False):
            if limited > free + 1e-6:  # a plan found elsewhere as fast as the limited optimum: this one is not needed
                for beat_s in (limited, (free + limited) / 2):  # the latter often beaten by one relaxation for all sets
                    with pytest.raises(NoBetterPlan) as beaten:
                        solve(problem, memory_limit_bytes=limit, reduce=reduce, beat_s=beat_s, unlimited_bound=bound)
                    assert not beaten.value.unlimited  # without the limit it would be faster: more room may still win
                found = solve(problem, memory_limit_bytes=limit, reduce=reduce, beat_s=limited + 1e-3,
                              unlimited_bound=bound)
                assert found.objective_s == pytest.approx(limited, abs=1e-9) and found.limited, (seed, bound)
            for beat_s, unlimited in ((free, None), (-1e6, True)):  # no plan is faster, limit or not
                with pytest.raises(NoBetterPlan) as beaten:
                    solve(problem, memory_limit_bytes=limit, reduce=reduce, beat_s=beat_s, unlimited_bound=bound)
                assert unlimited is None or not bound or beaten.value.unlimited  # below every relaxation: even unlimited
        if problem.regather:  # one relaxation for every set bounds them all (`autotp.solve.ilp._open_everywhere`)
            optimistic = list(_plans(least_of_sets(problem)))
            assert _best(optimistic) <= free + 1e-9 and _best(optimistic, limit) <= limited + 1e-9, seed
        with pytest.raises(MemoryInfeasible) as caught:
            solve(problem, memory_limit_bytes=memories[0] - _BYTES / 2, reduce=reduce)
        assert caught.value.smallest.objective_s * _BYTES == pytest.approx(memories[0])
    start = rng.choice(every)[0]  # a partial plan to keep, as the replicated warm start is kept
    kept = {g: c for g, c in start.items() if rng.random() < 0.6}
    agrees = lambda plans: [p for p in plans if all(p[0][g] == c for g, c in kept.items())]
    for time, memory, cap in ((True, False, None), (True, True, limit), (False, True, None)):
        by = "time" if time else "memory"
        left = []  # each set of regathered kinds is its own problem to the solver, and to the reduction
        for kinds in kind_sets(problem) if memory else [()]:
            variant = folded(problem, kinds)
            left += _plans(variant, reduce_problem(variant, time=time, memory=memory, keep=kept), recompute=memory)
        # folded and unfolded pieces add up in different orders: equal to rounding
        assert _best(left, cap, by) == pytest.approx(_best(every, cap, by), rel=1e-12), (seed, by, cap)
        assert _best(agrees(left), None, by) == pytest.approx(_best(agrees(every), None, by), rel=1e-12), \
            (seed, by, kept)


def test_a_repeated_block_is_its_stages_run_that_many_times():
    """The closed form the ILP uses for a repeated block against the recurrence, on a queue that builds up."""
    a, b = Stage(0, {"g": [3.0]}, {}, {"g": [1.0]}), Stage(1, {"g": [0.5]}, {}, {"g": [2.0]})
    unrolled = Chain([Block([a, b]) for _ in range(4)], {"g": [1.0]})
    folded = Chain([Block([a, b], 4)], {"g": [1.0]})
    group = Group("g", {"g": [0]}, [0.0], [1])
    problem = Problem({"g": group}, {"g": "g"}, {}, None, chain=folded)
    # each block adds 3.5 s of sums against 3 s of compute: the queue grows by 0.5 s a block, to 3 s, less 1 s after
    assert chain_times_s(unrolled, {"g": 0}) == chain_times_s(folded, {"g": 0}) == (14.0, 2.0)
    assert solve(problem).objective_s == pytest.approx(2.0)


def test_the_prefetch_wait_is_the_gathers_largest_lead_over_the_forward_pass():
    """ZeRO's all-gathers queue up ahead of the forward pass: it waits where they lead it most, repeats folded."""
    a, b = Stage(0, {"g": [3.0]}, {}, {"g": [1.0]}), Stage(1, {"g": [0.5]}, {}, {"g": [2.0]})
    # gathers 3, 0.5 a layer against compute 1, 2: the lead is 2 after a, 0.5 after b, and grows by 0.5 a layer
    for repeat, wait in ((1, 2.0), (4, 3.5)):
        unrolled = Chain([Block([a, b]) for _ in range(repeat)])
        folded = Chain([Block([a, b], repeat)])
        assert prefetch_times_s(unrolled, {"g": 0}) == prefetch_times_s(folded, {"g": 0}) == (3.5 * repeat, wait)
        group = Group("g", {"g": [0]}, [0.0], [1])
        assert solve(Problem({"g": group}, {"g": "g"}, {}, None, prefetch=folded)).objective_s == pytest.approx(wait)
    hidden = Chain([Block([Stage(0, {"g": [1.0]}, {}, {"g": [2.0]})], 5)])  # every gather hides behind compute
    assert prefetch_times_s(hidden, {"g": 0}) == (5.0, 0.0)


def test_ties_keep_one_choice():
    """Two identical choices and a worse one: the first stays, the others go."""
    group = Group("a", {"a": [0, 1, 2]}, [1.0, 1.0, 2.0], [8, 8, 8])
    other = Group("b", {"b": [0, 1]}, [0.0, 0.0], [1, 1])
    problem = Problem({"a": group, "b": other}, {"a": "a", "b": "b"}, {("a", "b"): [[1.0, 2.0]] * 3}, None)
    reduction = reduce_problem(problem, time=True, memory=True)
    assert reduction.choices == {"a": [0], "b": [0]}


def test_micro_batches_before_the_last_each_wait_for_their_sliced_gradients():
    """k - 1 early passes each run the sliced gradients' chain: its seconds and its wait count k - 1 times."""
    last = Chain([Block([Stage(0, {"g": [4.0]}, {}, {"g": [1.0]})])], {"g": [1.0]})  # 4 s of sums, 2 s of compute
    last.early = Chain([Block([Stage(0, {"g": [2.5]}, {}, {"g": [1.0]})])], {"g": [1.0]})  # sliced: 2.5 s
    last.earlier = 3
    group = Group("g", {"g": [0]}, [0.0], [1])
    problem = Problem({"g": group}, {"g": "g"}, {}, None, chain=last)
    # the last pass waits 4 - 1 = 3 s; each of the 3 before it 2.5 - 1 = 1.5 s
    assert chain_times_s(last, {"g": 0}) == (4.0 + 3 * 2.5, 3.0 + 3 * 1.5)
    assert solve(problem).objective_s == pytest.approx(7.5)


def test_the_quick_proof_that_a_branch_cannot_fit_keeps_the_optimum(monkeypatch):
    """With the quick check asked on every relaxation (the simplex given no time first), the limited optimum is
    the enumerated one, and no branch the least-memory relaxation rules out holds a plan that fits; over the 20
    problems and two limits, some branches are ruled out."""
    from autotp.solve import gap
    from autotp.solve.ilp import _may_fit

    monkeypatch.setattr(gap, "SIMPLEX_QUICK_ITERATIONS", 0)
    ruled_out = 0
    for seed, problem, every, memories in _solvable(range(1000, 1020)):
        for limit in (memories[0], memories[len(memories) // 3]):
            assert solve(problem, memory_limit_bytes=limit).objective_s == pytest.approx(
                _best(every, limit), abs=1e-9), seed
            for kinds in kind_sets(problem):
                variant = folded(problem, kinds)
                for whole in itertools.product((0, 1), repeat=len(problem.recompute)):
                    fixed = {(k, 0): bit for k, bit in enumerate(whole)}
                    if problem.partial_recompute or _may_fit(variant, fixed, limit, True):
                        continue
                    ruled_out += 1
                    counts = tuple((k, rc.count) for k, (rc, bit) in enumerate(zip(problem.recompute, whole)) if bit)
                    assert all(memory_bytes(problem, choice, counts, kinds) > limit for choice in _choices(problem)), \
                        (seed, kinds, whole)
    assert ruled_out >= 5


def _choices(problem: Problem):
    names = list(problem.groups)
    for picks in itertools.product(*(range(problem.groups[g].n) for g in names)):
        choice = dict(zip(names, picks))
        if not math.isinf(step_time(problem, choice).total_s):
            yield choice


def test_reduced_cost_fixing_and_the_rounded_start_keep_the_optimum(monkeypatch):
    """Under a binding limit each branch's MIP gets the binaries its relaxation's reduced costs prove too costly
    fixed to 0, and the first one is cut off at the plan rounded from its relaxation (`autotp.solve.fixing`,
    `autotp.solve.ilp._limited`): over 40 problems and two limits the limited optimum is still the enumerated
    one, and both happened."""
    from autotp.solve import ilp

    fixed, offered = [], []
    real_fix, real_offer = ilp.fix_beyond, ilp._Search.offer

    def fix(lp, duals, cutoff):
        out = real_fix(lp, duals, cutoff)
        fixed.extend(out)
        return out

    def offer(search, branch):
        taken = real_offer(search, branch)
        offered.append(taken)
        return taken

    monkeypatch.setattr(ilp, "fix_beyond", fix)
    monkeypatch.setattr(ilp._Search, "offer", offer)
    for seed, problem, every, memories in _solvable(range(2000, 2040)):
        for limit in (memories[len(memories) // 3], memories[len(memories) // 2]):
            assert solve(problem, memory_limit_bytes=limit).objective_s == pytest.approx(
                _best(every, limit), abs=1e-9), (seed, limit)
    assert fixed and any(offered), (len(fixed), offered)


def test_where_memory_does_not_bind_the_mip_starts_from_its_relaxation(monkeypatch):
    """Where the limit leaves the fastest plan room, the MIP without it is cut off at the plan completed or
    rounded from its relaxation, with the columns that relaxation's reduced costs prove no faster fixed to 0
    (`autotp.solve.ilp._from_relaxation`): over 40 problems, each with the completion and without (the rounded
    plan the cutoff), the optimum is still the enumerated one, columns were fixed, and both outcomes happened:
    the MIP found a faster plan, and it found none faster (the relaxation's plan was the optimum). Without a
    limit the MIP starts so too: the first test's optima without one."""
    from autotp.solve import ilp

    fixed, outcomes = [], set()
    real_fix, real_run = ilp.fix_beyond, ilp._run

    def fix(lp, duals, cutoff):
        out = real_fix(lp, duals, cutoff)
        fixed.extend(out)
        return out

    def run(lp, x, time_limit_s, solver="cbc", cutoff=None):
        out = real_run(lp, x, time_limit_s, solver, cutoff)
        if cutoff is not None and out.status == "Optimal":  # the cutoff: the relaxation's plan, and a margin
            outcomes.add("faster" if out.objective_s < cutoff / (1 + ilp._BOUND_MARGIN) - 1e-9 else "as fast")
        return out

    monkeypatch.setattr(ilp, "fix_beyond", fix)
    monkeypatch.setattr(ilp, "_run", run)
    completed = ilp._completed
    for seed, problem, every, memories in _solvable(range(3000, 3040)):
        for completes in (completed, lambda *args, **kwargs: None):  # the rounded plan, where none is completed
            monkeypatch.setattr(ilp, "_completed", completes)
            assert solve(problem, memory_limit_bytes=memories[-1]).objective_s == pytest.approx(
                _best(every), abs=1e-9), seed
    assert fixed and outcomes == {"faster", "as fast"}, (len(fixed), outcomes)


def test_a_binary_is_fixed_only_where_its_reduced_cost_passes_the_cutoff():
    """One of three choices costing 1, 2 and 10: the relaxation takes the first at 1, and a cutoff of 5 fixes the
    third (at least 1 + 9 > 5) but not the second (1 + 1); released, both are free again, and the MIP with the
    fixing finds the same optimum."""
    from autotp.solve import backends
    from autotp.solve.fixing import fix_beyond, relaxation_duals, release
    from autotp.solve.gap import lp_relaxation_bound
    from autotp.solve.linear import Model, total

    lp = Model()
    x = [lp.var(binary=True) for _ in range(3)]
    lp.eq(total(x), 1)
    lp.minimise(total(c * v for c, v in zip((1.0, 2.0, 10.0), x)))
    assert lp_relaxation_bound(lp) == pytest.approx(1.0)
    duals = relaxation_duals(lp)
    assert duals.bound == pytest.approx(1.0) and set(duals.reduced) == {1, 2}
    assert fix_beyond(lp, duals, None) == []
    pinned = fix_beyond(lp, duals, 5.0)
    assert pinned == [(2, 1.0)] and lp.upper[2] == 0.0 and lp.upper[1] == 1.0
    backends.solve_mip(lp, "highs", None, cutoff=5.0)
    assert lp.objective_value == pytest.approx(1.0)
    release(lp, pinned)
    assert lp.upper == [1.0, 1.0, 1.0]


def test_a_branch_beaten_in_every_set_is_bounded_in_none(monkeypatch):
    """With a plan to beat, the branches whose relaxation over `least_of_sets` is beaten are skipped in every
    set (`autotp.solve.ilp._open_everywhere`): over 40 problems, a target just above the limited optimum still
    finds it, and some searches went on with only part of their branches open."""
    from autotp.solve import ilp

    partial = []
    real = ilp._open_everywhere

    def open_everywhere(problem, limit, reduce, search, built=None, among=None):
        open_ = real(problem, limit, reduce, search, built, among)
        if among is None:  # every branch of every set: not a family's
            lp, x = ilp._model(least_of_sets(problem), "time", limit, reduce)
            partial.append(0 < len(open_) < len(ilp._branches(x)))
        return open_

    monkeypatch.setattr(ilp, "_open_everywhere", open_everywhere)
    for seed, problem, every, memories in _solvable(range(3000, 3040)):
        limit = memories[len(memories) // 3]
        limited = _best(every, limit)
        if limited is None or limited <= _best(every) + 1e-6:
            continue
        assert solve(problem, memory_limit_bytes=limit, beat_s=limited + 1e-3).objective_s == pytest.approx(
            limited, abs=1e-9), seed
    assert any(partial), partial


def test_the_sets_models_built_ahead_are_the_ones_the_search_solves(monkeypatch):
    """Without a plan to beat, the sets' models start building before the first relaxation solves
    (`autotp.solve.ilp._Builder.ahead`): where memory binds the search takes them and builds none again, with the
    enumerated optimum; where the most memory any plan may need fits twice over (`_most_plan_bytes`), none at all."""
    from autotp.solve import ilp

    builders, built, events = [], [], []
    real_init, real_build, real_bound = ilp._Builder.__init__, ilp._Builder._build, ilp.lp_relaxation_bound

    def init(self, problem, limit, reduce, keys):
        builders.append(list(keys))
        events.append("builder")
        real_init(self, problem, limit, reduce, keys)

    def bound(*args, **kwargs):
        events.append("relaxation")
        return real_bound(*args, **kwargs)

    def build(problem, key, limit, reduce):
        built.append(key)
        return real_build(problem, key, limit, reduce)

    monkeypatch.setattr(ilp._Builder, "__init__", init)
    monkeypatch.setattr(ilp._Builder, "_build", staticmethod(build))
    monkeypatch.setattr(ilp, "lp_relaxation_bound", bound)
    searched = 0
    for seed, problem, every, memories in _solvable(range(4000, 4030)):
        limit = memories[len(memories) // 3]
        if len(kind_sets(problem)) < 2 or _best(every, limit) is None or _best(every, limit) <= _best(every) + 1e-9:
            continue  # memory must bind, over several sets
        for log in (builders, built, events):
            log.clear()
        assert solve(problem, memory_limit_bytes=limit).objective_s == pytest.approx(_best(every, limit), abs=1e-9)
        # one builder, started before the first relaxation, the first set's model first
        assert len(builders) == 1 and builders[0][0] == (kind_sets(problem)[0], ()), (seed, builders)
        assert events[:2] == ["builder", "relaxation"], (seed, events[:3])
        assert len(built) == len(set(built)), seed  # no model built twice
        searched += 1
        builders.clear()
        assert solve(problem, memory_limit_bytes=2 * ilp._most_plan_bytes(problem)).objective_s == pytest.approx(
            _best(every), abs=1e-9)
        assert builders == [], seed
    assert searched >= 3, searched


def test_whether_memory_binds_is_asked_of_the_first_sets_model_first(monkeypatch):
    """With nothing to beat, the first set's model (every kind regathered), its limit's rows lifted, says first
    whether memory binds (`autotp.solve.ilp._first_set_binds`): where it says so the search starts there and no
    model without the limit is built; where it says no, that model is built, as before. Either way the optimum
    under the limit is the enumerated one, and over 40 problems both happen."""
    from autotp.solve import ilp

    said, unlimited = [], []
    real_binds, real_model = ilp._first_set_binds, ilp._model

    def binds(*args):
        said.append(real_binds(*args))
        return said[-1]

    def model(problem, minimise, memory_limit_bytes, reduce=True):
        if minimise == "time" and memory_limit_bytes is None:
            unlimited.append(problem)
        return real_model(problem, minimise, memory_limit_bytes, reduce)

    monkeypatch.setattr(ilp, "_first_set_binds", binds)
    monkeypatch.setattr(ilp, "_model", model)
    outcomes = {True: 0, False: 0}
    for seed, problem, every, memories in _solvable(range(5000, 5040)):
        limit = memories[len(memories) // 3]
        if _best(every, limit) is None:
            continue
        said.clear()
        unlimited.clear()
        assert solve(problem, memory_limit_bytes=limit).objective_s == pytest.approx(_best(every, limit), abs=1e-9)
        if said:
            assert len(said) == 1 and bool(unlimited) != said[0], (seed, said, len(unlimited))
            outcomes[said[0]] += 1
    assert min(outcomes.values()) >= 3, outcomes


def test_a_family_of_sets_bounds_them_all_and_a_beaten_one_drops_them(monkeypatch):
    """The sets parted by one kind (`autotp.solve.regather.families`) are each bounded by their `family`: its best
    plan under the limit is no slower than any of its sets' (enumerated), and with a plan to beat, or once the
    first set's search has one, a family beaten in every branch is dropped whole (`autotp.solve.ilp._families_open`)
    while the search still finds the enumerated optimum; over these problems some families were dropped."""
    from autotp.solve import ilp

    dropped = []
    real = ilp._families_open

    def families_open(problem, limit, reduce, search, built, pending, open_of):
        left = real(problem, limit, reduce, search, built, pending, open_of)
        dropped.append(len(pending) - len(left))
        return left

    monkeypatch.setattr(ilp, "_families_open", families_open)
    checked = 0
    for seed, problem, every, memories in _solvable(range(5000, 5060)):
        limit = memories[len(memories) // 3]
        limited = _best(every, limit)
        if len(problem.regather) < 2 or limited is None or limited <= _best(every) + 1e-6:
            continue  # memory must bind, over four sets
        split = split_kind(problem)
        for on, free, members in families(kind_sets(problem), split):
            least = _best(_plans(family(problem, on, free)), limit)
            for kinds in members:
                assert split not in free and set(on) <= set(kinds) <= set(on) | set(free), (seed, kinds)
                alone = _best(_plans(folded(problem, kinds)), limit)
                assert alone is None or least <= alone + 1e-9, (seed, kinds)
        assert solve(problem, memory_limit_bytes=limit).objective_s == pytest.approx(limited, abs=1e-9), seed
        assert solve(problem, memory_limit_bytes=limit, beat_s=limited + 1e-3).objective_s == pytest.approx(
            limited, abs=1e-9), seed
        checked += 1
    assert checked >= 5 and any(dropped), (checked, dropped)


def test_the_completed_plan_keeps_the_relaxations_whole_groups_and_releases_its_pins():
    """`_completed`, the opening target of a search under the limit: over random problems under a binding limit,
    each branch's recompute binaries pinned as `_limited` pins them, the plan keeps every group the relaxation put
    whole on one choice, is a plan no faster than the enumerated best under the limit where it fits, and leaves
    the model's bounds as they were (the set's other branches use the model); some relaxations left groups split,
    which the plan settles."""
    from autotp.solve import ilp
    from autotp.solve.gap import lp_relaxation_bound

    completed = settled = 0
    for seed, problem, every, memories in _solvable(range(3000, 3060)):
        limit = memories[len(memories) // 3]
        for kinds in kind_sets(problem):
            variant = folded(problem, kinds)
            lp, x = ilp._model(variant, "time", limit)
            for fixed in ilp._branches(x):
                ilp._fix(x, fixed)
                if lp_relaxation_bound(lp) is None:
                    continue
                values, bounds = list(lp.values), (list(lp.lower), list(lp.upper))
                choice = ilp._completed(lp, x, "highs")
                assert (lp.lower, lp.upper) == bounds, seed
                if choice is None:
                    continue
                completed += 1
                whole = {g: c for g, xs in x.items() if g != ilp._RECOMPUTE for c, v in xs.items()
                         if values[v.index] > ilp._WHOLE}
                assert all(choice[g] == c for g, c in whole.items()), (seed, kinds, fixed)
                settled += len(whole) < len(variant.groups)
                recompute = ilp._fixed_recompute(x, fixed)
                if recompute is not None and memory_bytes(variant, choice, recompute) <= limit:
                    assert step_time(variant, choice, recompute).total_s >= _best(every, limit) - 1e-9, seed
    assert completed >= 20 and settled, (completed, settled)
