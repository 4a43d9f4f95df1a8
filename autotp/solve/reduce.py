"""Exact reductions before the ILP: dead-end elimination of group choices and edge pairs.

The ILP's size is mostly Alpa's edge-pair variables, one per possible pair of
choices on every edge (GPT-3-175B on 8x8: 15,648 of 16,578 variables), and
many of them can never be needed. Goldstein's dead-end elimination, from
protein design (pick one rotamer per residue under pairwise energies: the
same problem), says which, exactly:

* **choices**: choice ``j`` of a group goes if another choice ``k`` is never
  worse, whatever the neighbours pick: for every criterion,
  ``node[k] - node[j] + sum over the group's edges of max over the
  neighbour's choices m of (edge[k, m] - edge[j, m]) <= 0``
  (a pair ``(k, m)`` that cannot happen where ``(j, m)`` can makes the max
  infinite). Any plan on ``j`` switched to ``k`` is then as good or better;
* **pairs**: pair ``(i, j)`` on edge ``(u, v)`` goes if, with ``u`` on ``i``,
  some ``k`` is never worse than ``j`` for ``v``: the same sum, with that
  edge taken at row ``i`` instead of its worst case (for a group with one
  edge, a parameter feeding its op, that is: keep, per choice of the op,
  the parameter's choices no other beats on both time and memory);
* **dead ends**: a choice with no pair left on one of its edges cannot be picked.

The criteria are what the ILP adds up: the exposed time; the memory per
device when it is minimised or limited (the limit is a knapsack, so a switch
may not buy time with memory); and when gradient reductions may hide behind
the backward pass, the overlappable time (may not grow) and the backward
compute (may not shrink), since the ILP charges ``max(0, overlap - backward)``.
Each step keeps an optimal plan in the reduced problem, so the optimum is
unchanged. Ties keep the lower index, so the result is deterministic.
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

    ``time``: the exposed time is minimised; ``memory``: memory is minimised
    or limited. ``keep`` (group -> choice, for some groups) protects a partial
    plan, the replicated warm start: its choices, and their pairs with each
    other and with every choice of a group it leaves open, are never
    dominated away, so if some plan extends it, one still does after the
    reduction (a time-limited solve can start from it).
    """
    state = _State(problem, _criteria(problem, time, memory), keep or {})
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


def _criteria(problem: Problem, time: bool, memory: bool) -> list[tuple[dict, dict]]:
    """``(node vectors, edge tables)`` per criterion, each to be no larger after a switch."""
    groups, criteria = problem.groups, []
    if time:
        criteria.append(({g: grp.cost_s for g, grp in groups.items()}, problem.edges))
        if problem.overlap_edges or any(any(grp.overlap_s) for grp in groups.values()):
            criteria.append(({g: grp.overlap_s for g, grp in groups.items()}, problem.overlap_edges))
            criteria.append(({g: [-b for b in grp.backward_s] for g, grp in groups.items()}, {}))
    if memory:
        criteria.append(({g: grp.memory_bytes for g, grp in groups.items()}, {}))

    def finite(values):  # an infinite cost is an impossible choice or pair: the masks exclude it
        return np.nan_to_num(np.array(values, dtype=float), posinf=0.0)

    return [({g: finite(v) for g, v in node.items()}, {e: finite(t) for e, t in edge.items()})
            for node, edge in criteria]


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
        self.worst_cache = {}

    def reduction(self) -> Reduction:
        return Reduction({g: np.flatnonzero(a).tolist() for g, a in self.alive.items()}, self.pairs)

    def oriented(self, table: np.ndarray, side: int) -> np.ndarray:
        """``table`` with the rows on the group at ``side`` of its edge (a view: writes go through)."""
        return table if side == 0 else table.T

    def edge_table(self, criterion, e) -> np.ndarray:
        table = criterion[1].get(e)
        return np.zeros(self.pairs[e].shape) if table is None else table

    def worst(self, c: int, e, side) -> np.ndarray:
        """``W[k, j]``: the most switching ``j`` to ``k`` can add on edge ``e``, over the neighbour's choices."""
        if (c, e, side) not in self.worst_cache:
            pairs = self.oriented(self.pairs[e], side)
            cost = self.oriented(self.edge_table(self.criteria[c], e), side)
            diff = np.where(pairs[:, None, :], cost[:, None, :] - cost[None, :, :], np.inf)  # [k, j, m]
            self.worst_cache[c, e, side] = np.where(pairs[None, :, :], diff, -np.inf).max(axis=2)
        return self.worst_cache[c, e, side]

    def base(self, g: str, skip=None) -> list[np.ndarray]:
        """Per criterion, ``B[k, j]``: node difference plus the worst case on every edge of ``g`` but ``skip``.

        ``nan`` (``inf - inf``) where ``j`` is a dead end: never a dominance, and gone next pass anyway.
        """
        out = []
        for c, (node, _) in enumerate(self.criteria):
            total = node[g][:, None] - node[g][None, :]
            for e, side in self.incident[g]:
                if (e, side) != skip:
                    total = total + self.worst(c, e, side)
            out.append(total)
        return out

    def drop_choices(self, g: str) -> bool:
        dominates = np.logical_and.reduce([b <= 0 for b in self.base(g)])
        survivors = _survivors(dominates, self.alive[g], self.keep[g])
        if (survivors == self.alive[g]).all():
            return False
        self.kill(g, ~survivors & self.alive[g])
        return True

    def drop_pairs(self, e: tuple[str, str], side: int) -> bool:
        """Pairs of edge ``e`` that the group at ``1 - side`` never needs, per choice ``i`` of the one at ``side``."""
        g, other = e[1 - side], e[side]
        pairs = self.oriented(self.pairs[e], side)  # [i: the other end's choice, j: g's choice]
        dominates = np.logical_and.reduce([
            b[None, :, :] + (t[:, :, None] - t[:, None, :]) <= 0  # [i, k, j]
            for b, t in zip(self.base(g, skip=(e, 1 - side)),
                            (self.oriented(self.edge_table(c, e), side) for c in self.criteria))])
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
        for e, side in self.incident[g]:
            self.oriented(self.pairs[e], side)[dead, :] = False
            self.forget(e)

    def forget(self, e) -> None:
        for key in [k for k in self.worst_cache if k[1] == e]:
            del self.worst_cache[key]


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
