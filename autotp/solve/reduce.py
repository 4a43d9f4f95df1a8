"""Exact reductions before the ILP: dead-end elimination of group choices and edge pairs.

The ILP's size is mostly Alpa's edge-pair variables, one per possible pair of
choices on every edge, and many of them can never be needed. Goldstein's
dead-end elimination, from protein design (pick one rotamer per residue
under pairwise energies: the same problem), says which, exactly:

* **choices**: choice ``j`` of a group goes if another choice ``k`` is never
  worse, whatever the neighbours pick: for every criterion,
  ``N[k, j] + sum over the group's edges of max over the neighbour's choices
  m of E[k, j, m] <= 0``, where ``N`` and ``E`` bound from above what
  switching ``j`` to ``k`` can add at the group itself and on each edge (a
  pair ``(k, m)`` that cannot happen where ``(j, m)`` can makes the max
  infinite). Any plan on ``j`` switched to ``k`` is then as good or better;
* **pairs**: pair ``(i, j)`` on edge ``(u, v)`` goes if, with ``u`` on ``i``,
  some ``k`` is never worse than ``j`` for ``v``: the same sum, with that
  edge taken at ``m = i`` instead of its worst case;
* **dead ends**: a choice with no pair left on one of its edges cannot be picked.

The bounds, per piece of the step model (`autotp.solve.problem`):

* costs of groups and edges add up: the bound is the difference itself;
* a fan-out item is paid once whoever needs it, so a switch that keeps a use
  on the same redistribution (same source layout and target) adds nothing,
  and any other may add the new item's whole cost (and saves at least 0);
* memory adds up over groups and over the gathered inputs kept for
  backward, which live on edges (the difference) and fan-out items (paid
  once, as the time's); where the peak is the larger of backward's start
  and end (`autotp.solve.step.memory_bytes`), each moment is a criterion;
* the gradient chain's wait (`autotp.solve.chain`) grows with every gradient
  sum and shrinks with every second of backward compute, by at most the
  change: the bound adds the positive part of each term's change; the same
  holds for the prefetch chain's wait (`autotp.solve.prefetch`), with ZeRO's
  all-gathers and the forward compute, and for the early micro-batches'
  chain, times their number;
* an inference program's largest working set (`autotp.solve.working`) is a
  maximum over groups: a switch that does not grow its group's own leaves
  it where it was, so that is a criterion of its own;
* a layer class's recomputation (`autotp.solve.recompute`) adds the forward
  seconds of the group's choice if the class is recomputed, and frees its
  activation bytes: the bound adds the rise of the one and the fall of the
  other (freeing more raises the transient by at most 1/layers of it, so
  that never adds memory).

The criteria are what the ILP adds up: the time, and the memory per device
when it is minimised or limited (the limit is a knapsack, so a switch may not
buy time with memory). Each step keeps an optimal plan in the reduced
problem, so the optimum is unchanged. Ties keep the lower index, so the
result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autotp.solve.problem import Problem


@dataclass
class Reduction:
    """What the ILP keeps: per group the choices left, per edge a boolean matrix of the pairs left."""

    choices: dict[str, list[int]]
    pairs: dict[tuple[str, str], np.ndarray]


def reduce_problem(problem: Problem, time: bool = True, memory: bool = False,
                   keep: dict[str, int] | None = None) -> Reduction:
    """Dead-end elimination until nothing changes.

    ``time``: the step time is minimised; ``memory``: memory is minimised
    or limited. ``keep`` (group -> choice, for some groups) protects a partial
    plan, the replicated warm start: its choices, and their pairs with each
    other and with every choice of a group it leaves open, are never
    dominated away, so if some plan extends it, one still does after the
    reduction (a time-limited solve can start from it).
    """
    recompute = memory and bool(problem.recompute)  # the ILP has recompute choices only when memory counts
    criteria = [_TimeBounds(problem, recompute)] if time else []
    if memory:  # with one micro-batch the peak is the larger of two moments: a switch may raise neither
        criteria += [_MemoryBounds(problem, recompute)] + ([_StateBounds(problem)] if problem.peak_in_backward else [])
        criteria += [_WorkingBounds(problem)] if problem.working else []
    state = _State(problem, criteria, keep or {})
    changed = True
    with np.errstate(invalid="ignore"):  # inf - inf where a choice is a dead end: see _State.base
        while changed:
            changed = any([state.drop_choices(g) for g in state.alive])
            changed = any([state.drop_pairs(e, side) for e in state.pairs for side in (0, 1)]) or changed
            changed = state.drop_dead_ends() or changed
    if not all(a.any() for a in state.alive.values()):  # no plan at all: the solver says so, as without reduction
        return possible(problem)
    return state.reduction()


def possible(problem: Problem) -> Reduction:
    """No elimination: every choice of finite cost, every pair of them with a finite edge cost."""
    return _State(problem, [], {}).reduction()


def _finite(values) -> np.ndarray:
    """Costs as floats, infinite ones as 0: the masks of possible choices and pairs exclude them."""
    return np.nan_to_num(np.array(values, dtype=float), posinf=0.0)


def _rise(values: np.ndarray) -> np.ndarray:
    """``D[k, j] = max(0, values[k] - values[j])``: the most a chain term can grow by switching j to k."""
    return np.maximum(0.0, values[:, None] - values[None, :])


def _switch(items: np.ndarray, cost: np.ndarray, ident: np.ndarray) -> np.ndarray:
    """``B[k, j, ...]``: what switching a use's choice from j to k may add to a fan-out (items ``[choice, ...]``).

    Nothing when both need the same redistribution; else the new item's whole cost.
    """
    new, old = items[:, None], items[None, :]
    return np.where(ident[new] == ident[old], 0.0, cost[new])


class _Bounds:
    """Switch bounds per group (``node[g][k, j]``) and per edge (terms that ``edge`` turns into ``E[k, j, m]``)."""

    def __init__(self, problem: Problem, node: dict, edges: dict):
        self.problem, self.node = problem, node
        self.edge_terms: dict[tuple, list] = {e: [] for e in problem.edges}
        for e, table in edges.items():
            self.edge_terms[e].append(("diff", _finite(table)))

    def _add_fanouts(self, cost_of) -> None:
        """Fan-out items at ``cost_of(fanout)`` each: paid once, whoever needs them."""
        groups = self.problem.groups
        for fanout in self.problem.fanouts:
            costs = cost_of(fanout)
            if not any(costs):
                continue
            cost = np.append(np.array(costs, dtype=float), 0.0)  # index -1: nothing
            ident = np.append(np.array(fanout.ident, dtype=np.int64), -1)  # -1: nothing (no item's number)
            gu = fanout.producer
            for arm in fanout.arms:
                items = np.array(arm.items)  # [producer choice, consumer choice]
                gv = arm.consumer
                if gv is None or gv == gu or groups[gv].n == 1:
                    self.node[gu] = self.node[gu] + _switch(items[:, 0], cost, ident)
                elif groups[gu].n == 1:
                    self.node[gv] = self.node[gv] + _switch(items[0], cost, ident)
                else:
                    self.edge_terms[gu, gv].append(("shared", items, cost, ident))

    def edge(self, e, side: int) -> np.ndarray:
        """``E[k, j, m]`` for the group at ``side`` of ``e`` switching ``j`` to ``k``, the other end on ``m``."""
        total = 0.0
        for term in self.edge_terms[e]:
            if term[0] == "shared":
                _, items, cost, ident = term
                total = total + _switch(items if side == 0 else items.T, cost, ident)
            else:
                table = term[1] if side == 0 else term[1].T
                diff = table[:, None, :] - table[None, :, :]
                total = total + (np.maximum(0.0, diff) if term[0] == "rise" else diff)
        return total


class _TimeBounds(_Bounds):
    """The step time's switch bounds: exact differences, fan-out items, and the chains' positive parts."""

    def __init__(self, problem: Problem, recompute: bool = False):
        super().__init__(problem, {g: _finite(group.cost_s)[:, None] - _finite(group.cost_s)[None, :]
                                   for g, group in problem.groups.items()}, problem.edges)
        self._add_fanouts(lambda fanout: fanout.cost_s)
        for chain in (problem.chain, problem.prefetch):
            if chain is not None:
                self._add_chain(chain)
        if recompute:  # a recomputed class runs its forward again: the switch may add the rise of that time
            for rc in problem.recompute:
                for g, values in rc.forward_s.items():
                    self.node[g] = self.node[g] + _rise(np.array(values, dtype=float))

    def _add_chain(self, chain, times: int = 1) -> None:
        for block in chain.blocks:
            n = times * block.repeat  # each repeat is one more stage whose terms may rise
            for stage in block.stages:
                for g, values in stage.reduce_nodes.items():
                    self.node[g] = self.node[g] + n * _rise(np.array(values, dtype=float))
                for e, table in stage.reduce_pairs.items():
                    self.edge_terms[e].append(("rise", n * np.array(table, dtype=float)))
                for g, values in stage.before.items():
                    self.node[g] = self.node[g] + n * _rise(-np.array(values, dtype=float))
        for g, values in chain.after.items():
            self.node[g] = self.node[g] + times * _rise(-np.array(values, dtype=float))
        if chain.early is not None:  # the early micro-batches' chain, paid ``earlier`` times
            self._add_chain(chain.early, times * chain.earlier)


class _MemoryBounds(_Bounds):
    """Memory per device adds up: groups, kept gathered inputs on edges and fan-outs, and what recomputing frees
    (as backward starts, without the gradients, where the peak is the larger of two moments)."""

    def __init__(self, problem: Problem, recompute: bool = False):
        two_moments = problem.peak_in_backward

        def start(group):
            if not two_moments:
                return _finite(group.memory_bytes)
            return _finite(group.memory_bytes) - _finite(group.gradient_bytes)

        super().__init__(problem, {g: start(group)[:, None] - start(group)[None, :]
                                   for g, group in problem.groups.items()}, problem.edge_memory)
        self._add_fanouts(lambda fanout: fanout.memory_bytes)
        if recompute:  # a recomputed class frees bytes: the switch may add the fall of what it frees
            for rc in problem.recompute:
                for g, values in rc.saved_bytes.items():
                    self.node[g] = self.node[g] + _rise(-np.array(values, dtype=float))


class _StateBounds(_Bounds):
    """The model's state as backward ends (parameters, gradients, optimizer state, buffers): groups alone."""

    def __init__(self, problem: Problem):
        super().__init__(problem, {g: _finite(group.state_bytes)[:, None] - _finite(group.state_bytes)[None, :]
                                   for g, group in problem.groups.items()}, {})


class _WorkingBounds(_Bounds):
    """An inference program's largest working set (`autotp.solve.working`): a maximum over groups, which a switch
    leaves where it was if the group's own working set does not grow."""

    def __init__(self, problem: Problem):
        def rise(g, group):
            values = _finite(problem.working.get(g, [0] * group.n))
            return values[:, None] - values[None, :]

        super().__init__(problem, {g: rise(g, group) for g, group in problem.groups.items()}, {})


class _State:
    """Alive choices and pairs, and the dominance tests over them."""

    def __init__(self, problem: Problem, criteria, keep: dict[str, int]):
        self.criteria = criteria
        self.alive = {g: np.isfinite(np.array(grp.cost_s, dtype=float)) for g, grp in problem.groups.items()}
        self.keep = {g: np.arange(len(a)) == keep.get(g, -1) for g, a in self.alive.items()}  # one-hot or none
        self.pairs = {(u, v): np.isfinite(np.array(t, dtype=float)) & self.alive[u][:, None] & self.alive[v][None, :]
                      for (u, v), t in problem.edges.items()}
        self.incident = {g: [] for g in problem.groups}  # group -> [(edge, side)], side 0: the group is the rows
        for u, v in problem.edges:
            self.incident[u].append(((u, v), 0))
            self.incident[v].append(((u, v), 1))
        self.bounds_cache, self.worst_cache = {}, {}
        # a test whose inputs (its group's choices and its edges' pairs) are as they were when it last ran would
        # drop nothing again: each pass after the first runs only where something changed (the 4 passes over
        # Llama-2-70B's 147 groups at batch 8 ran 1,716 tests, now 861)
        self.version, self.changed, self.ran = 0, {g: 0 for g in self.alive}, {}

    def reduction(self) -> Reduction:
        return Reduction({g: np.flatnonzero(a).tolist() for g, a in self.alive.items()}, self.pairs)

    def oriented(self, table: np.ndarray, side: int) -> np.ndarray:
        """``table`` with the rows on the group at ``side`` of its edge (a view: writes go through)."""
        return table if side == 0 else table.T

    def bounds(self, c: int, e, side: int):
        """``E[k, j, m]`` of criterion ``c`` (fixed for the problem: cached for good)."""
        if (c, e, side) not in self.bounds_cache:
            self.bounds_cache[c, e, side] = self.criteria[c].edge(e, side)
        return self.bounds_cache[c, e, side]

    def worst(self, c: int, e, side) -> np.ndarray:
        """``W[k, j]``: the most switching ``j`` to ``k`` can add on edge ``e``, over the neighbour's choices."""
        if (c, e, side) not in self.worst_cache:
            pairs = self.oriented(self.pairs[e], side)
            n, m = pairs.shape
            bound = np.broadcast_to(self.bounds(c, e, side), (n, n, m))
            diff = np.where(pairs[:, None, :], bound, np.inf)  # [k, j, m]
            self.worst_cache[c, e, side] = np.where(pairs[None, :, :], diff, -np.inf).max(axis=2)
        return self.worst_cache[c, e, side]

    def base(self, g: str, skip=None) -> list[np.ndarray]:
        """Per criterion, ``B[k, j]``: the group's own bound plus the worst case on every edge of ``g`` but ``skip``.

        ``nan`` (``inf - inf``) where ``j`` is a dead end: never a dominance, and gone next pass anyway.
        """
        out = []
        for c, criterion in enumerate(self.criteria):
            total = criterion.node[g]
            for e, side in self.incident[g]:
                if (e, side) != skip:
                    total = total + self.worst(c, e, side)
            out.append(total)
        return out

    def fresh(self, test: tuple, g: str) -> bool:
        """Whether ``test`` on group ``g`` (or one of its edges) has run since ``g``'s choices or pairs last changed."""
        if self.ran.get(test, -1) >= self.changed[g]:
            return True
        self.ran[test] = self.version
        return False

    def drop_choices(self, g: str) -> bool:
        if self.fresh(("choices", g), g):
            return False
        dominates = np.logical_and.reduce([b <= 0 for b in self.base(g)])
        survivors = _survivors(dominates, self.alive[g], self.keep[g])
        if (survivors == self.alive[g]).all():
            return False
        self.kill(g, ~survivors & self.alive[g])
        return True

    def drop_pairs(self, e: tuple[str, str], side: int) -> bool:
        """Pairs of edge ``e`` that the group at ``1 - side`` never needs, per choice ``i`` of the one at ``side``."""
        g, other = e[1 - side], e[side]
        if self.fresh(("pairs", e, side), g):
            return False
        pairs = self.oriented(self.pairs[e], side)  # [i: the other end's choice, j: g's choice]
        n = pairs.shape[1]
        dominates = np.logical_and.reduce([
            b[None, :, :] + np.broadcast_to(self.bounds(c, e, 1 - side), (n, n, pairs.shape[0])).transpose(2, 0, 1)
            <= 0  # [i, k, j]
            for c, b in enumerate(self.base(g, skip=(e, 1 - side)))])
        kept_other = self.keep[other] if self.keep[other].any() else np.ones_like(self.keep[other])
        survivors = _survivors(dominates, pairs, kept_other[:, None] & self.keep[g][None, :])
        if (survivors == pairs).all():
            return False
        pairs &= survivors
        self.forget(e)
        return True

    def drop_dead_ends(self) -> bool:
        """Choices with no pair left on one of their edges."""
        changed = False
        for g, alive in self.alive.items():
            linked = alive.copy()
            for e, side in self.incident[g]:
                linked &= self.oriented(self.pairs[e], side).any(axis=1)
            dead = alive & ~linked
            if dead.any():
                self.kill(g, dead)
                changed = True
        return changed

    def kill(self, g: str, dead: np.ndarray) -> None:
        self.alive[g] &= ~dead
        self.touch(g)
        for e, side in self.incident[g]:
            self.oriented(self.pairs[e], side)[dead, :] = False
            self.forget(e)

    def forget(self, e) -> None:
        """Edge ``e``'s pairs changed: its worst cases go, and both its groups' tests run again."""
        for key in [k for k in self.worst_cache if k[1] == e]:
            del self.worst_cache[key]
        self.touch(*e)

    def touch(self, *groups: str) -> None:
        self.version += 1
        for g in groups:
            self.changed[g] = self.version


def _survivors(dominates: np.ndarray, alive: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Which of ``alive`` (``[..., j]``) stay when ``dominates[..., k, j]`` says ``k`` is never worse than ``j``.

    Of choices that dominate each other the lowest index stays; each one
    dropped has a survivor that dominates it directly (no reliance on
    transitivity, which rounding could break); ``keep`` always stays.
    """
    n = alive.shape[-1]
    dominates = dominates & alive[..., :, None] & alive[..., None, :] & ~np.eye(n, dtype=bool)
    later = np.tri(n, k=-1, dtype=bool)  # [k, j]: k > j
    beaten = (dominates & ~(np.swapaxes(dominates, -1, -2) & later)).any(axis=-2) & ~keep
    stays = alive & ~beaten
    beaten &= (dominates & stays[..., :, None]).any(axis=-2)
    return alive & ~beaten
