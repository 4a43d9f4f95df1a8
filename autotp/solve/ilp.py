"""The ILP: one binary choice per group, edge-pair variables for resharding costs, as a `linear.Model`.

Linearisation (Alpa's row/column-sum encoding): for an edge between groups u
and v, continuous ``y[i][j] >= 0`` with ``sum_j y[i][j] = x_u[i]`` and
``sum_i y[i][j] = x_v[j]``. With one-hot ``x`` this forces ``y`` to the one
chosen pair, and the LP relaxation stays tight. Pairs that cannot happen
(infinite cost) get no variable, nor do the choices and pairs that dead-end
elimination proves unneeded (`autotp.solve.reduce`: the same optimum, often
half the variables). Variables are named after fx nodes.

The objective is the step model of `autotp.solve.problem`, term for term, so
its optimum is the plan's predicted step time (`autotp.solve.step`):

* a fan-out item (one redistribution of a tensor with several uses) is a
  continuous ``w >= 0`` at least every use's indicator of needing it, paid
  once;
* the gradient chain's wait is one continuous ``lag`` per stage and the
  recurrence's ``max`` as two inequalities each (`autotp.solve.chain`);
* the prefetch chain's wait (ZeRO's all-gathers behind the next forward
  pass) is one continuous ``wait`` at least each stage's lead
  (`autotp.solve.prefetch`).

Coefficients are scaled to microseconds and MiB for the solver's tolerances;
the objective is reported in seconds. A memory limit is one more linear
constraint: the sum over groups of each choice's bytes per device (with
one micro-batch of training, one row for each of the peak's two moments),
and for an inference program one continuous ``working`` at least each
group's working set (`autotp.solve.working`). Under a
binding limit each set of regathered kinds (`autotp.solve.regather`) is
solved as its own problem and the fastest plan kept.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import product
from typing import NamedTuple

from autotp.errors import SolverError
from autotp.solve import backends
from autotp.solve.fixing import Duals, fix_beyond, relaxation_duals, release
from autotp.solve.gap import (complete_start, lp_relaxation_bound, optimality_gap, replicated_choices,
                              warm_start_replicated, warn_gap)
from autotp.solve.linear import Lin, Model, total
from autotp.solve.problem import Problem
from autotp.solve.recompute import layer_counts
from autotp.solve.regather import families, family, folded, kind_sets, least_of_sets, split_kind
from autotp.solve.reduce import possible, reduce_problem
from autotp.solve.step import memory_bytes, regather_effect, step_time

_SCALE = 1e6  # seconds -> microseconds inside the solver
_BYTES = 2 ** 20  # bytes -> MiB inside the solver


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # group leader -> chosen index
    objective_s: float
    variables: int
    constraints: int
    solve_s: float
    status: str
    gap: float | None = None  # only when a time limit stopped the solver: (objective - bound) / objective
    solver: str = "cbc"
    recompute: tuple[tuple[int, int], ...] = ()  # (index into problem.recompute, how many of its layers)
    regather: tuple[str, ...] = ()  # the kinds of gathered inputs gathered again in backward (`autotp.solve.regather`)
    limited: bool = False  # solved under the memory limit: the fastest plan did not fit


class MemoryInfeasible(Exception):
    """No choice fits the memory limit; ``smallest`` is the solution that uses the least memory."""

    def __init__(self, smallest: "Solution"):
        super().__init__("no plan fits the memory limit")
        self.smallest = smallest


def _model(problem: Problem, minimise: str, memory_limit_bytes: float | None, reduce: bool = True):
    """The ILP minimising step time (``"time"``) or per-device memory (``"memory"``).

    ``reduce``: only the choices and pairs `reduce_problem` leaves get variables;
    the replicated plan is kept among them, as the warm start of a time-limited solve.
    """
    lp = Model()
    x, objective, memory, state = {}, [], [], []
    counts_memory = minimise == "memory" or memory_limit_bytes is not None
    # the peak: every term, or with one micro-batch the larger of two moments (`autotp.solve.step.memory_bytes`):
    # ``memory`` as backward starts (every term but the gradients), ``state`` as it ends
    two_moments = counts_memory and problem.peak_in_backward
    replicated = replicated_choices(problem)  # the warm start of a time-limited solve, kept by dead-end elimination
    reduced = reduce_problem(problem, time=minimise == "time", memory=counts_memory,
                             keep=replicated) if reduce else possible(problem)
    for name, group in problem.groups.items():
        allowed = reduced.choices[name]
        if not allowed:
            raise SolverError(f"op {name!r} has no strategy with a finite cost; this is a bug, please report it")
        x[name] = {c: lp.var(binary=True) for c in allowed}
        columns = [v.index for v in x[name].values()]
        lp.row(columns, [1.0] * len(columns), 1.0, 1.0)
        # each piece's terms as one expression (not a product per variable: a model has some 80,000 terms)
        objective.append(Lin(columns, [group.cost_s[c] * _SCALE for c in allowed]))
        if not two_moments:
            memory.append(Lin(columns, [group.memory_bytes[c] / _BYTES for c in allowed]))
            continue
        memory.append(Lin(columns, [(group.memory_bytes[c] - group.gradient_bytes[c]) / _BYTES for c in allowed]))
        state.append(_terms(x[name], {c: group.state_bytes[c] / _BYTES for c in allowed}))
    if counts_memory and problem.working:  # inference: the largest working set, a column above each group's
        working = lp.var()
        for name, values in problem.working.items():
            lp.ge(working, Lin([x[name][c].index for c in x[name]], [values[c] / _BYTES for c in x[name]]))
        memory.append(working)
    y = {}
    for (gu, gv), table in problem.edges.items():
        y[gu, gv] = _pair_variables(lp, x[gu], x[gv], reduced.pairs[gu, gv])
        objective.append(_pair_terms(y[gu, gv], table, _SCALE))
    for w, seconds, nbytes in _fanout_items(lp, problem, x, y, every=minimise == "time"):
        if minimise == "time":
            objective.append(seconds * _SCALE * w)
        if counts_memory and nbytes:
            memory.append(nbytes / _BYTES * w)
    if counts_memory:
        for e, table in problem.edge_memory.items():
            memory.append(_pair_terms(y[e], table, 1 / _BYTES))
    if minimise == "time":
        if problem.chain is not None:
            objective.append(_chain_wait(lp, problem.chain, x, y))
        if problem.prefetch is not None:
            objective.append(_prefetch_wait(lp, problem.prefetch, x, y))
    r = {}
    if problem.recompute and counts_memory:
        r = _recompute_terms(lp, problem, x, objective, memory)
    rows = [total(memory), total(state)] if two_moments else [total(memory)]
    if memory_limit_bytes is not None:
        lp.labels[_LIMIT] = [lp.le(row, memory_limit_bytes / _BYTES) for row in rows]
    if minimise == "time":
        lp.minimise(total(objective))
    else:
        peak = rows[0]
        if len(rows) > 1:
            peak = lp.var()
            for row in rows:
                lp.ge(peak, row)
        lp.minimise(peak)
    warm_start_replicated(x, replicated)  # CBC starts from it only under a time limit (autotp.solve.gap)
    x = dict(x)
    x[_RECOMPUTE] = r
    return lp, x


_RECOMPUTE = "__recompute__"  # the key of the recompute binaries among the choice variables
_LIMIT = "memory limit"  # the label of the memory limit's rows (`Model.labels`)


def _recompute_terms(lp, problem: Problem, x: dict, objective: list, memory: list) -> dict:
    """Per layer class ``(layers per binary, binaries)``: how many of its layers it recomputes; their forward
    seconds again and their freed bytes (`autotp.solve.recompute`)."""
    bits, transient = {}, lp.var()
    for k, rc in enumerate(problem.recompute):
        sizes = layer_counts(rc.count, problem.partial_recompute)
        bits[k] = sizes, [lp.var(binary=True) for _ in sizes]
        if sum(sizes) > rc.count:
            lp.le(total(n * b for n, b in zip(*bits[k])), rc.count)
        for n, b in zip(*bits[k]):
            share = n / rc.count
            for g, values in rc.forward_s.items():
                most = max(values[c] for c in x[g]) * _SCALE * share
                if most > 0:
                    t = lp.var()
                    lp.ge(t, total(values[c] * _SCALE * share * v for c, v in x[g].items()) - most * (1 - b))
                    objective.append(t)
            freed = []
            for g, values in rc.saved_bytes.items():
                most = max(values[c] for c in x[g]) / _BYTES * share
                if most > 0:
                    z = lp.var()
                    lp.le(z, total(values[c] / _BYTES * share * v for c, v in x[g].items()))
                    lp.le(z, most * b)
                    freed.append(z)
            memory += [-z for z in freed]
            lp.ge(transient, total(freed) * (1.0 / n))
    memory.append(transient)
    return bits


def _use_indicator(problem: Problem, x: dict, y: dict, fanout, arm, i: int, j: int):
    """The 0/1 expression "the producer is on ``i`` and this use's consumer on ``j``" (None: cannot be)."""
    gu, gv = fanout.producer, arm.consumer
    if gv is None or gv == gu or problem.groups[gv].n == 1:
        return x[gu].get(i)
    if problem.groups[gu].n == 1:
        return x[gv].get(j)
    return y[gu, gv].get((i, j))


def _fanout_items(lp, problem: Problem, x: dict, y: dict, every: bool) -> list[tuple]:
    """``(w, seconds, bytes)`` per fan-out item: ``w >= (a use needs it)`` per use, so it is paid once.

    ``every`` item (the time objective), or only those holding a gathered
    input kept for backward (bytes for the memory row). An item only one use
    needs is that use's indicator itself (its pairs are one-hot, so the sum
    is 0 or 1): ``w`` would equal it at every optimum, as seconds and bytes
    are never negative, so it gets neither a variable nor a row (1,185 of
    Llama-2-70B's 30,412 rows on 4x8, which every LP relaxation, run without
    presolve, carried).
    """
    terms = []
    for f, fanout in enumerate(problem.fanouts):
        needs: dict[int, dict[int, list]] = {}  # item -> use -> indicators of needing it
        for a, arm in enumerate(fanout.arms):
            for i, row in enumerate(arm.items):
                for j, item in enumerate(row):
                    indicator = _use_indicator(problem, x, y, fanout, arm, i, j) if item >= 0 else None
                    if indicator is not None:
                        needs.setdefault(item, {}).setdefault(a, []).append(indicator)
        for item, by_arm in needs.items():
            nbytes = fanout.memory_bytes[item] if fanout.memory_bytes else 0
            if not (every or nbytes):
                continue
            if len(by_arm) == 1:  # one use needs it: paid when that use is, no variable or row of its own
                terms.append((total(*by_arm.values()), fanout.cost_s[item], nbytes))
                continue
            # at least its uses' indicators, and never cheaper or smaller above them: 0 or 1 in a plan worth finding
            w = lp.var(zero_one=fanout.cost_s[item] >= 0 and nbytes >= 0)
            for indicators in by_arm.values():
                lp.row([w.index] + [v.index for v in indicators], [1.0] + [-1.0] * len(indicators), 0.0, math.inf)
            terms.append((w, fanout.cost_s[item], nbytes))
    return terms


def _linear(x: dict, y: dict, nodes: dict, pairs: dict) -> list[Lin]:
    """The seconds of a chain's terms (per group choice ``nodes``, per edge pair ``pairs``), one expression each."""
    out = [_terms(x[g], {c: values[c] * _SCALE for c in x[g]}) for g, values in nodes.items()]
    return out + [_pair_terms(y[e], table, _SCALE) for e, table in pairs.items()]


def _chain_wait(lp, chain, x: dict, y: dict):
    """The seconds the step waits for the gradient queue (`autotp.solve.chain`), as LP variables.

    Per stage ``lag >= reduce`` and ``lag >= reduce + previous lag - before``;
    a block repeated ``n`` times maps the lag before it to at least each of
    ``lag + n*D``, ``C + (n-1)*D`` and ``C`` (``C``: the lag one block builds
    from nothing, ``D``: its gradient seconds less its compute); then ``wait
    >= lag - after``, ``wait >= 0``. Minimising ``wait`` makes each bound the
    max the recurrence takes. The early chain of micro-batches before the
    last is the same construction, its wait paid ``earlier`` times.
    """
    lag = 0
    for block in chain.blocks:
        if block.repeat == 1:
            for stage in block.stages:
                lag = _stage_lag(lp, lag, stage, x, y)
            continue
        fresh = 0
        for stage in block.stages:
            fresh = _stage_lag(lp, fresh, stage, x, y)
        delta = total([t for stage in block.stages for t in _linear(x, y, stage.reduce_nodes, stage.reduce_pairs)]
                      + [-t for stage in block.stages for t in _linear(x, y, stage.before, {})])
        out, n = lp.var(), block.repeat
        lp.ge(out, lag + n * delta)
        lp.ge(out, fresh + (n - 1) * delta)
        lp.ge(out, fresh)
        lag = out
    wait = lp.var()
    lp.ge(wait, lag - total(_linear(x, y, chain.after, {})))
    if chain.early is None:
        return wait
    return wait + chain.earlier * _chain_wait(lp, chain.early, x, y)


def _prefetch_wait(lp, chain, x: dict, y: dict):
    """The seconds the forward pass waits for ZeRO's all-gathers (`autotp.solve.prefetch`), as LP variables.

    ``wait >= 0`` and ``wait >=`` the gathers' lead over the compute at every
    stage: the lead when a block starts (a variable per block, so no row
    grows with depth) plus the block's own terms up to the stage, at the
    block's first and (repeated ``n`` times) last layer.
    """
    wait = lp.var()
    lead = 0
    for block in chain.blocks:
        own, rows = [], []
        for stage in block.stages:
            own += _linear(x, y, stage.reduce_nodes, {}) + [-t for t in _linear(x, y, stage.before, {})]
            rows.append(list(own))
        for terms in rows:
            lp.ge(wait, lead + total(terms))
            if block.repeat > 1:
                lp.ge(wait, lead + (block.repeat - 1) * total(own) + total(terms))
        after = lp.var(low=-math.inf)
        lp.eq(after, lead + block.repeat * total(own))
        lead = after
    return wait


def _stage_lag(lp, previous, stage, x: dict, y: dict):
    reduce = total(_linear(x, y, stage.reduce_nodes, stage.reduce_pairs))
    lag = lp.var()
    lp.ge(lag, reduce)
    if not isinstance(previous, int):
        lp.ge(lag, reduce + previous - total(_linear(x, y, stage.before, {})))
    return lag


def _run(lp, x, time_limit_s, solver: str = "cbc", cutoff: float | None = None) -> Solution:
    start = time.perf_counter()
    if time_limit_s is not None:
        complete_start(lp)  # a start for every variable: a solver stopped at the limit still holds a plan
    backends.solve_mip(lp, solver, time_limit_s, cutoff)
    elapsed = time.perf_counter() - start
    if lp.status != "Optimal":
        return Solution({}, math.inf, lp.n_vars, lp.n_rows, elapsed, lp.status, solver=solver)
    recompute = _recomputed(x, lambda k, j, bit: bit.value() > 0.5)
    choice = {name: next(c for c, v in xs.items() if v.value() > 0.5) for name, xs in x.items() if name != _RECOMPUTE}
    objective, gap = lp.objective_value, None
    if not lp.proven:  # stopped at the time limit holding an incumbent
        gap = optimality_gap(objective, lp_relaxation_bound(lp, time_limit_s))
    return Solution(choice, objective, lp.n_vars, lp.n_rows, elapsed, lp.status, gap, solver, recompute)


_BOUND_MARGIN = 1e-6  # a relaxation's optimum within the LP solver's tolerance of beat_s proves nothing


class NoBetterPlan(Exception):
    """This problem's fastest plan under the memory limit is no faster than ``beat_s``; ``unlimited``: not even
    without the limit (then neither is any problem that only adds work, such as more micro-batches)."""

    def __init__(self, message: str, unlimited: bool = True):
        super().__init__(message)
        self.unlimited = unlimited


class MemoryBinds(Exception):
    """The fastest plan needs many times the memory limit, and the caller asked to hear so before the search
    under the limit (``solve(..., defer_over=...)``): it may first find a plan elsewhere to beat, then solve
    the same problem with that plan's step time as ``beat_s``."""


def solve(problem: Problem, time_limit_s: float | None = None, memory_limit_bytes: float | None = None,
          solver: str = "auto", reduce: bool = True, beat_s: float | None = None,
          defer_over: float | None = None, found=None, unlimited_bound: bool = True) -> Solution:
    """Pick one strategy per group minimising the predicted step time, within the memory limit.

    ``solver`` is ``"auto"``, ``"cbc"`` or ``"highs"`` (`autotp.solve.backends`).
    ``reduce=False`` skips dead-end elimination (`autotp.solve.reduce`): the
    same optimum from a larger ILP, for tests and comparisons. A memory limit
    that the fastest plan meets changes nothing, so the knapsack row is added
    only when that plan does not fit (then a second solve, under the limit);
    when the LP relaxation's rounded plan is well over the limit, the fastest
    plan is taken not to fit unsolved (the solve under the limit finds the
    same optimum either way, only ``limited`` may then be True needlessly).
    With nothing to beat or defer to, that is first asked of the first set's
    model under the limit, which the search would build anyway, with the
    limit's rows lifted (`_first_set_binds`): its plans regather every kind,
    so they need less memory, and where even its rounded plan is well over
    the limit the search starts there, the model without the limit never built.
    Raises `MemoryInfeasible` carrying the least-memory plan when nothing fits,
    and `NoBetterPlan` when the fastest plan, limit or not, is no faster than
    ``beat_s`` (a plan found another way: the limited solve is not needed),
    first tried on the LP relaxation's bound, which often settles it alone.
    ``defer_over``: raise `MemoryBinds` instead of searching under the limit when the fastest plan (or the
    relaxation's rounded guess at it) needs more than ``defer_over`` times the limit.
    ``found(seconds)`` hears of each plan under the limit that a branch's MIP proves its best and that beats
    the plans before it, as the search goes, and of the opening set's completed plan where it is close to its
    bound (`_Search.report`): a plan to beat for searches elsewhere (`autotp.lanes`).
    ``unlimited_bound=False``: with ``beat_s`` and a limit, the problem is first bounded under the limit at once,
    not without it (`_bounded_first`): where ``beat_s`` comes from a plan of more micro-batches, which only add
    work, the bound without the limit is below it and proves nothing. Where that leaves a branch open, the
    search goes on as it would have without the flag (the same plan, and whether memory bound it).
    """
    solver = backends.resolve(solver)
    if beat_s is not None and memory_limit_bytes is not None and time_limit_s is None and defer_over is None:
        if not unlimited_bound:  # beaten under the limit, or searched as though nothing were skipped
            _bounded_first(problem, memory_limit_bytes, reduce, solver, beat_s, unlimited=False)
        open_ = _bounded_first(problem, memory_limit_bytes, reduce, solver, beat_s)
        if open_ is not None:
            return _limited_or_raise(problem, memory_limit_bytes, reduce, None, solver, beat_s, 0.0, found, open_)
    ahead = _Builder.ahead(problem, memory_limit_bytes, reduce, time_limit_s, beat_s is not None)
    try:
        unbounded = ahead is not None and beat_s is None and defer_over is None  # nothing to beat or defer to
        if unbounded and _first_set_binds(problem, memory_limit_bytes, ahead):
            return _limited_or_raise(problem, memory_limit_bytes, reduce, None, solver, None, 0.0, found, built=ahead)
        lp, x = _model(problem, "time", None, reduce)
        relaxed, duals = None, None
        if time_limit_s is None:
            # the LP relaxation bounds the fastest plan from below, at a fraction of the MIP's time (its values
            # would spoil a time-limited solve's warm start), its rounding says whether memory likely binds, and
            # its duals and plan start the MIP (`_from_relaxation`)
            bound = lp_relaxation_bound(lp)
            if beat_s is not None and bound is not None and bound / _SCALE >= beat_s * (1 + _BOUND_MARGIN):
                raise NoBetterPlan(f"at least {bound / _SCALE:.6g} s (LP relaxation) >= {beat_s:.6g} s")
            relaxed = _rounded(x) if bound is not None and memory_limit_bytes is not None else None
            duals = relaxation_duals(lp) if bound is not None else None
        if relaxed is not None and memory_bytes(problem, relaxed) > memory_limit_bytes * (1 + _ROUNDED_MARGIN):
            if defer_over is not None and memory_bytes(problem, relaxed) > defer_over * memory_limit_bytes:
                raise MemoryBinds()
            return _limited_or_raise(problem, memory_limit_bytes, reduce, time_limit_s, solver, beat_s, 0.0, found,
                                     built=ahead)
        free = _run(lp, x, time_limit_s, solver) if duals is None else _from_relaxation(problem, lp, x, solver, duals)
        if beat_s is not None and free.status == "Optimal" and free.objective_s / _SCALE >= beat_s:
            raise NoBetterPlan(f"{free.objective_s / _SCALE:.6g} s >= {beat_s:.6g} s")
        if memory_limit_bytes is None or (free.status == "Optimal"
                                          and memory_bytes(problem, free.choice, free.recompute) <= memory_limit_bytes):
            return _finish(free, time_limit_s)
        if (defer_over is not None and free.status == "Optimal"
                and memory_bytes(problem, free.choice, free.recompute) > defer_over * memory_limit_bytes):
            raise MemoryBinds()
        return _limited_or_raise(problem, memory_limit_bytes, reduce, time_limit_s, solver, beat_s, free.solve_s,
                                 found, built=ahead)
    finally:
        if ahead is not None:
            ahead.close()


_ROUNDED_MARGIN = 0.05  # a rounded relaxation this far over the limit: the fastest plan almost surely does not fit


def _from_relaxation(problem: Problem, lp, x: dict, solver: str, duals: Duals) -> Solution:
    """The MIP of ``lp`` without a memory limit (none, or one its fastest plan may meet), whose relaxation was just
    solved to ``duals``, started from what that relaxation gives: its plan completed (`_completed`), or else
    rounded (`_rounded`), as the cutoff, and every column its reduced costs prove no faster than that plan fixed
    to 0 (`autotp.solve.fixing`). The optimum is the MIP's (that plan is below the cutoff, so of plans as fast
    the MIP picks as it did without one), or that plan where the solver's tolerances leave the MIP none: exact
    as `_limited`'s branches are.

    Without them HiGHS spends its root node finding what the relaxation already says: on Mistral of hidden size
    1024 on 2x4 over InfiniBand (40,000 columns, 2,400 binaries; the relaxation leaves 81 of 154 groups split,
    too many to complete) the MIP took 21 to 23 s, 20.6 s of them before its own heuristics found the optimum.
    The rounded plan, 3.4% above the relaxation, fixes 17,000 columns, and the MIP then takes 2.3 s. Llama-2-70B
    on 4x8 over Ethernet without a limit (`benchmarks/plan_time.py`) solved in 17.0 and 19.2 s, against 27.2 and
    32.1 s, the same optimum."""
    start = time.perf_counter()
    rounded, completed = _relaxation_plans(lp, x, solver)
    plans = [rounded] + [completed] * (completed is not None)
    target, choice = min((step_time(problem, plan).total_s * _SCALE, i, plan) for i, plan in enumerate(plans))[::2]
    if not math.isfinite(target):
        return _run(lp, x, None, solver)
    solution = _run_fixed(lp, x, None, solver, target * (1 + _BOUND_MARGIN), duals)
    elapsed = time.perf_counter() - start
    if solution.status not in ("Infeasible", backends.CUT_OFF):
        return replace(solution, solve_s=elapsed)  # the MIP's optimum (of plans as fast, its pick), or its failure
    return Solution(choice, target, lp.n_vars, lp.n_rows, elapsed, "Optimal", solver=solver)


def _first_set_binds(problem: Problem, limit: float, built: "_Builder") -> bool:
    """Whether the limit binds as the first set's model says it: its relaxation with the limit's rows lifted,
    rounded, is a plan over the limit (`_ROUNDED_MARGIN`) even with every kind regathered (which only frees
    memory). The search under the limit starts on that model, from that relaxation's basis, so a count with no
    plan to beat that memory binds at (Llama-2-70B at batch 64, 16 micro-batches: its rounded plan needs 1.25
    times the limit, the one without the limit 1.39 times) is not first bounded on a model without the limit,
    a model and a relaxation more (0.5 s and 0.4 s). Where it says no, `solve` asks the model without the
    limit, as before."""
    variant, (lp, x) = built.peek((kind_sets(problem)[0], ()))
    with _limit_lifted(lp):
        bound = lp_relaxation_bound(lp)
    return bound is not None and memory_bytes(variant, _rounded(x)) > limit * (1 + _ROUNDED_MARGIN)


@contextmanager
def _limit_lifted(lp):
    """``lp`` with its memory limit's rows (`_LIMIT`) lifted, and put back on leaving: a relaxation of it then
    bounds the plans without the limit, and the next one, under it, starts from that relaxation's basis."""
    limits = [(row, lp.row_lower[row], lp.row_upper[row]) for row in lp.labels.get(_LIMIT, [])]
    try:
        for row, low, _ in limits:
            lp.set_row_bounds(row, low, math.inf)
        yield lp
    finally:
        for row, low, up in limits:
            lp.set_row_bounds(row, low, up)


def _rounded(x: dict) -> dict[str, int]:
    """Each group's choice of largest value in a solved LP relaxation (the relaxation is nearly integral here:
    within 0.1% of the integer optimum on Llama-2-70B), as a cheap guess at the fastest plan."""
    return {name: max(xs, key=lambda c: xs[c].value() or 0.0) for name, xs in x.items() if name != _RECOMPUTE}


_MOST_OPEN = 32  # groups a relaxation leaves split between choices, at most, for `_completed` to search them


def _completed(lp, x: dict, solver: str, cutoff: float | None = None) -> dict[str, int] | None:
    """The fastest plan that keeps each group the LP relaxation just solved put whole on one choice: a MIP over
    the few groups it left split (Berthold's RENS), or None where there are more than `_MOST_OPEN` of them, or
    the solver is not HiGHS (whose presolve drops the pinned columns at once).

    The relaxation is nearly integral here: at Llama-2-70B on 4x8, batch 8, it leaves 3 of 147 groups split, and
    this MIP takes 0.12 s for a plan 0.036% above the optimum, where rounding each group to its largest value
    (`_rounded`) gives one 2.7% above. As the first target of `_limited` that cuts the branch's MIP from 2.25 s
    to 1.1 s (reduced-cost fixing pins 665 binaries, not 271), and a lane's plan to beat comes seconds earlier.
    The pins are undone before it returns: the model serves the set's other branches (its values and status are
    the MIP's then). ``cutoff``: only a plan below it is wanted (None where there is none).
    """
    if solver != "highs" or lp.values is None:
        return None
    values = lp.values
    whole = {g: [c for c, v in xs.items() if values[v.index] > _WHOLE] for g, xs in x.items() if g != _RECOMPUTE}
    if sum(len(cs) != 1 for cs in whole.values()) > _MOST_OPEN:
        return None
    pinned = [(v.index, lp.lower[v.index], lp.upper[v.index]) for g, cs in whole.items() if len(cs) == 1
              for c, v in x[g].items() if c != cs[0] and lp.upper[v.index] > 0.0]
    try:
        for j, low, _ in pinned:
            lp.set_bounds(j, low, 0.0)
        solution = _run(lp, x, None, solver, cutoff)
    finally:
        for j, low, up in pinned:
            lp.set_bounds(j, low, up)
    return solution.choice if solution.status == "Optimal" else None


def _relaxation_plans(lp, x: dict, solver: str, cutoff: float | None = None) -> tuple[dict, dict | None]:
    """The plans the LP relaxation just solved on ``lp`` gives: rounded (`_rounded`), and completed
    (`_completed`, None where there is none), read in that order, as the completion's MIP leaves its own values
    on the model."""
    rounded = _rounded(x)
    return rounded, _completed(lp, x, solver, cutoff)


def _run_fixed(lp, x, time_limit_s, solver: str, cutoff: float | None, duals: Duals | None) -> Solution:
    """`_run` with the columns that ``duals`` (a relaxation's of ``lp``) prove no faster than ``cutoff`` fixed
    to 0 for this solve (`autotp.solve.fixing`), and free again after it: the model serves other solves."""
    pinned = fix_beyond(lp, duals, cutoff)
    try:
        return _run(lp, x, time_limit_s, solver, cutoff)
    finally:
        release(lp, pinned)


_REPORT_WITHIN = 0.005  # an offered plan this close to its set's bound is told to other lanes before the MIP
_WHOLE = 1.0 - 1e-6  # a relaxation's value this close to 1 puts the group whole on that choice


def _limited_or_raise(problem: Problem, memory_limit_bytes: float, reduce: bool, time_limit_s, solver: str,
                      beat_s: float | None, earlier_s: float, found=None, open_: list | None = None,
                      built: "_Builder | None" = None) -> Solution:
    """The fastest plan under the limit (`_limited`), or the error that says there is none."""
    solution = _limited(problem, memory_limit_bytes, reduce, time_limit_s, solver, beat_s, found, open_, built)
    if solution.status == "Beaten":
        raise NoBetterPlan(f"under the memory limit no faster than {beat_s:.6g} s", unlimited=False)
    if solution.status == "Infeasible":
        # no limit: the error quotes this exact minimum, every kind regathered (which only frees memory)
        everything = kind_sets(problem)[0]
        smallest = _run(*_model(folded(problem, everything), "memory", None, reduce), None, solver)
        smallest = _effective(problem, replace(smallest, regather=everything))
        if time_limit_s is None or smallest.objective_s * _BYTES > memory_limit_bytes:
            raise MemoryInfeasible(smallest)
        # a CBC stopped by its time limit can call a feasible problem infeasible: report the limit instead
        solution = Solution({}, math.inf, solution.variables, solution.constraints, solution.solve_s, "Not Solved",
                            solver=solver)
    return replace(_finish(solution, time_limit_s, earlier_s), limited=True)


def _effective(problem: Problem, solution: Solution) -> Solution:
    """``solution`` without the regather kinds that change nothing under its choices (a set tried whose kind
    has nothing to regather there), so the plan names only what the lowering has to do."""
    if solution.status != "Optimal":
        return solution
    kinds = tuple(k for k in solution.regather if any(regather_effect(problem, solution.choice, (k,))))
    return replace(solution, regather=kinds)


def _limited(problem: Problem, limit: float, reduce: bool, time_limit_s, solver: str,
             beat_s: float | None = None, found=None, open_: list | None = None,
             built: "_Builder | None" = None) -> Solution:
    """The fastest plan under the memory limit, over every set of regathered kinds (`autotp.solve.regather`).

    Each set is its own problem, and each is cut further into *branches*,
    one per value of its layer classes' recompute binaries (when there are
    at most `_MOST_BRANCHES` of them; `_branches`). A branch's LP relaxation
    bounds its plans from below, and is tight where the whole problem's is
    not: with a recompute binary fractional, the relaxation buys half a
    recomputation's memory for half its time. So a branch is skipped when
    its bound is no faster than the *target*: the best plan so far, or
    ``beat_s`` (a plan found another way; when every branch is skipped so,
    the status is ``"Beaten"``). While there is no target, the first set
    (the largest: the most room) has every branch bounded first, each
    relaxation completed to a plan (`_completed`: its few split groups
    searched by a small MIP; 0.04% above the optimum on Llama-2-70B at
    batch 8, where rounding gave 2.7%), where it fits, taken as the target
    when it beats it, and told to ``found`` when within `_REPORT_WITHIN` of
    the least bound (`_Search.report`), and its branch of least bound solved at once (at batch 64 the branch
    that recomputes every layer bounds at 9.37 s and the one that
    recomputes none at 7.29 s: solving the first, as found, cost a 4 s MIP
    for a target 28% above the optimum); every later relaxation is solved
    with the target as its cutoff, so HiGHS's dual simplex stops as soon as its
    objective, a lower bound all along, passes it; the survivors are solved
    in order of their bounds (ties: the larger set first), each MIP handed
    the binaries its relaxation's reduced costs prove worse than the target
    fixed to 0 (`autotp.solve.fixing`). Bounds and order
    are skipped under a time limit, which solves each set whole. A branch
    whose relaxation is infeasible has no plan, and is not solved. With a
    target from the start (``beat_s``), one relaxation per branch bounds
    every set at once first (`_open_everywhere`, or ``open_``: the branches
    it left open, found by `solve` already): a micro-batch count that
    cannot win is set aside before any set's model is built, and a branch
    beaten in every set is bounded in none. Once there is a target, from
    the start or from the first set, the sets left are bounded by family
    first (`_families_open`): a family beaten is dropped whole. Exact: the
    branches partition the plans, and a bound never exceeds its branch's
    optimum.
    """
    cutoff = beat_s * _SCALE if beat_s is not None else None
    search = _Search(problem, limit, reduce, time_limit_s, solver, cutoff, found)
    survivors: list[_Branch] = []
    bounded = kind_sets(problem)
    if time_limit_s is not None:  # no bounds: each set is solved whole, its ILP built when it is solved
        survivors = [_Branch(0.0, i, kinds, folded(problem, kinds), {}) for i, kinds in enumerate(bounded)]
        bounded = []
    # the branches some set may hold a plan faster than the target in (None: all of them)
    if open_ is None and cutoff is not None and len(bounded) > 1:
        open_ = _open_everywhere(problem, limit, reduce, search)
        if not open_:
            return search.result()
    open_of = dict.fromkeys(bounded, open_)  # each set's branches left open (None: all of them)
    with built if built is not None else _Builder(problem, limit, reduce, _model_order(problem, cutoff is not None)) \
            as built:
        pending, parted = list(bounded), False
        while pending:
            if not parted and search.target() is not None:  # a target: the sets' families bounded first
                parted = True
                pending = _families_open(problem, limit, reduce, search, built, pending, open_of)
                continue
            kinds = pending.pop(0)
            variant, model = built.get((kinds, ()))
            opening = search.target() is None  # no target yet: every branch of this set bounded, its best solved
            opened = []
            for fixed in _branches(model[1]) if open_of[kinds] is None else open_of[kinds]:
                _fix(model[1], fixed)
                bound = _branch_bound(model[0], variant, fixed, limit, reduce, search)
                if bound is None or search.skips(bound):
                    continue  # not even fractional choices fit, or no plan of this branch beats the target
                branch = _Branch(bound, len(survivors) + len(opened), kinds, variant, fixed, model,
                                 relaxation_duals(model[0]))
                if opening:
                    search.offer(branch)
                    opened.append(branch)
                else:
                    survivors.append(branch)
            if opened:
                best = min(opened, key=_Branch.order_key)
                search.report(best.bound)
                if not search.skips(best.bound):
                    search.solve(best)
                if search.failed is not None:
                    return search.failed
                survivors += [b for b in opened if b is not best]
    for branch in sorted(survivors, key=_Branch.order_key):
        if not search.skips(branch.bound):
            search.solve(branch)
        if search.failed is not None:
            return search.failed
    return search.result()


def _model_order(problem: Problem, target: bool) -> list[tuple]:
    """The models `_limited` asks for, as `(on, free)` keys of `family` (a set is its own family, nothing free),
    in the order it likely asks: without a target the first set, whose search makes one; then, with a target, a
    model per family of two sets or more (`_families_open`), and each set alone in its family. The sets of a
    family are built only once its relaxation leaves them a branch (`_Builder.want`)."""
    sets = kind_sets(problem)
    opening = [] if target else sets[:1]
    parts = families(sets[len(opening):], split_kind(problem))
    return ([(kinds, ()) for kinds in opening] + [(on, free) for on, free, members in parts if len(members) > 1]
            + [(members[0], ()) for _, _, members in parts if len(members) == 1])


def _families_open(problem: Problem, limit: float, reduce: bool, search: "_Search", built: "_Builder",
                   pending: list[tuple], open_of: dict) -> list[tuple]:
    """The sets of ``pending`` left to bound one by one, once there is a target: the sets are parted by the kind
    whose regathering weighs most (`autotp.solve.regather.split_kind`), and each part of two sets or more is
    bounded first by one relaxation per branch over its `family` (every set's plans costed no more): a part
    beaten in every branch is dropped whole, and the branches it leaves open are the only ones its sets bound
    (``open_of``, narrowed in place). At Llama-2-70B batch 8 the two sets that do not regather activations go
    with one model and two relaxations, where each took its own; with two micro-batches all four sets do.
    Exact as `_open_everywhere` is: a family's bound is at most each of its sets'."""
    left = set()
    for on, free, members in families(pending, split_kind(problem)):
        if len(members) > 1:
            open_ = _open_everywhere(problem, limit, reduce, search, built.get((on, free)), open_of[members[0]])
            if not open_:
                continue
            open_of.update(dict.fromkeys(members, open_))
        for kinds in members:
            built.want((kinds, ()))
        left.update(members)
    return [kinds for kinds in pending if kinds in left]


class _Branch(NamedTuple):
    """One value of a set's recompute binaries, bounded and waiting to be solved (`_limited`)."""

    bound: float  # its relaxation's optimum (0 under a time limit: unbounded)
    order: int  # when it was bounded: of equal bounds, the earlier (the larger set) is solved first
    kinds: tuple  # the set of regathered kinds
    variant: Problem  # the problem with those kinds folded in (`autotp.solve.regather.folded`)
    fixed: dict  # its recompute binaries' values
    model: tuple | None = None  # the set's ILP under the limit, or None: built when solved
    duals: Duals | None = None  # its relaxation's, for reduced-cost fixing (`autotp.solve.fixing`)

    def order_key(self) -> tuple:
        return self.bound, self.order


def _branch_bound(lp, variant: Problem, fixed: dict, limit: float, reduce: bool, search: "_Search") -> float | None:
    """The LP relaxation's bound of one branch (its recompute binaries pinned), stopped at the search's target;
    None when not even fractional choices fit. A bound the LP solver gave up on proves nothing: ``-inf``."""
    bound = lp_relaxation_bound(lp, cutoff=search.cutoff_now(),
                                infeasible=lambda: not _may_fit(variant, fixed, limit, reduce))
    if bound is None and lp.status == "Infeasible":
        return None
    return -math.inf if bound is None else bound


def _bounded_first(problem: Problem, limit: float, reduce: bool, solver: str, beat_s: float,
                   unlimited: bool = True) -> list[dict] | None:
    """With a plan to beat and a memory limit, the count bounded on the one model `_open_everywhere` builds,
    before any other: the branches it leaves open, or None where memory may not bind.

    Its relaxation with the limit's rows lifted bounds the fastest plan of
    every set, limit or not (`least_of_sets` costs each plan no more than
    any set does): no faster than ``beat_s``, the count is beaten even
    unlimited (`NoBetterPlan`, a ceiling for the counts above it). Where
    its rounding fits the limit (within `_ROUNDED_MARGIN`), memory may not
    bind, and None sends `solve` on as without a limit. Otherwise the rows
    go back and each branch is bounded under them; none open, the count is
    beaten under the limit. Bounding the unlimited problem on a model of
    its own first, as `solve` does without a plan to beat, cost each count
    that loses under the limit a model and a relaxation more: Llama-2-70B
    at batch 64 against 7.334 s, 4 micro-batches took 1.4 s that way and
    0.8 s this one, 2 micro-batches 1.35 and 1.1 s (8 and 1 about as long).

    Not ``unlimited``: the branches are bounded under the limit at once. Against
    the 7.334 s of 16 micro-batches at batch 64, the counts below it bound at
    5.5 to 6.4 s without the limit, which proves nothing, and the branches'
    relaxations from scratch take about as long as from that bound's basis:
    8 micro-batches were beaten in 0.81 s that way, not 1.41 s, one in 0.96 s,
    not 1.55 s (2 and 4 about as long).
    """
    search = _Search(problem, limit, reduce, None, solver, beat_s * _SCALE)
    built = variant, (lp, x) = _least_model(problem, limit, reduce)
    if not unlimited:
        return _open_or_beaten(problem, limit, reduce, search, built, beat_s)
    with _limit_lifted(lp):
        bound = lp_relaxation_bound(lp, cutoff=search.cutoff_now())
    if bound is None:
        return None  # the relaxation settled nothing: `solve`'s own path says why
    if search.skips(bound):
        raise NoBetterPlan(f"at least {bound / _SCALE:.6g} s (LP relaxation) >= {beat_s:.6g} s")
    if memory_bytes(problem, _rounded(x)) <= limit * (1 + _ROUNDED_MARGIN):
        return None
    return _open_or_beaten(problem, limit, reduce, search, built, beat_s)


def _open_or_beaten(problem: Problem, limit: float, reduce: bool, search: "_Search", built: tuple,
                    beat_s: float) -> list[dict]:
    """`_open_everywhere`'s branches, or `NoBetterPlan` (under the limit) where it leaves none open."""
    open_ = _open_everywhere(problem, limit, reduce, search, built)
    if not open_:
        raise NoBetterPlan(f"under the memory limit no faster than {beat_s:.6g} s", unlimited=False)
    return open_


def _open_everywhere(problem: Problem, limit: float, reduce: bool, search: "_Search",
                     built: tuple | None = None, among: list[dict] | None = None) -> list[dict]:
    """The branches in which some set of regathered kinds may hold a plan under the limit faster than the
    search's target, by one relaxation per branch for every set at once.

    `least_of_sets` costs each plan no more, and in no more memory, than any
    set does, so a branch its relaxation proves beaten by the target (or
    unable to fit) is so in every set: a micro-batch count that cannot win
    is set aside after one model and a relaxation per branch, where the sets
    one by one take a model and a relaxation each, and a count that may win
    has only its open branches bounded set by set (at 70B batch 8 two
    micro-batches recomputing every layer bound at 1.178 s over every set,
    above the 1.065 s to beat: four relaxations of 0.1 to 1.9 s saved).
    ``built``: that problem and its model under the limit, already made (`_bounded_first`), or a family's
    (`_families_open`); ``among``: the branches to bound (None: all of them).
    """
    variant, (lp, x) = built if built is not None else _least_model(problem, limit, reduce)
    open_ = []
    for fixed in _branches(x) if among is None else among:
        _fix(x, fixed)
        bound = _branch_bound(lp, variant, fixed, limit, reduce, search)
        if bound is not None and not search.skips(bound):
            open_.append(fixed)
    return open_


def _least_model(problem: Problem, limit: float, reduce: bool) -> tuple:
    """`least_of_sets` of ``problem``, and its ILP under the limit."""
    variant = least_of_sets(problem)
    return variant, _model(variant, "time", limit, reduce)


class _Builder:
    """The ILPs under the limit that the search asks for (a set's, or a family's: `_model_order`), built in a
    thread ahead of their use: HiGHS releases the GIL while it solves the ones before, so on two cores the next
    model (a second of Python for Llama-2-70B) is built while the last one solves. The models are the same as
    built on the spot; one asked for and not wanted yet is built then."""

    def __init__(self, problem, limit: float, reduce: bool, keys):
        self.problem, self.limit, self.reduce = problem, limit, reduce
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotp-ilp-build")
        self.pending = {}
        for key in keys:
            self.want(key)

    @staticmethod
    def _build(problem, key, limit, reduce):
        variant = family(problem, *key)
        return variant, _model(variant, "time", limit, reduce)

    @classmethod
    def ahead(cls, problem, limit: float | None, reduce: bool, time_limit_s, target: bool) -> "_Builder | None":
        """The models started now, while the relaxation without the limit solves and says whether the search
        under the limit is needed (the first set's model then waits no longer: a second at Llama-2-70B), or
        None where no search under the limit can follow (no limit, or `_most_plan_bytes` fits it) or the search
        builds each set's model when it solves it (a time limit); ``target``: the search will have one."""
        if limit is None or time_limit_s is not None or _most_plan_bytes(problem) <= limit:
            return None
        return cls(problem, limit, reduce, _model_order(problem, target))

    def want(self, key) -> None:
        """Model ``key`` queued, after those wanted before it, unless it already is."""
        if key not in self.pending:
            self.pending[key] = self.pool.submit(self._build, self.problem, key, self.limit, self.reduce)

    def get(self, key):
        self.want(key)
        return self.pending.pop(key).result()

    def peek(self, key):
        """Model ``key``, left for `get` to hand over."""
        self.want(key)
        return self.pending[key].result()

    def close(self) -> None:
        """No more models: the one being built is left to finish, and dropped."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # a search that returns early builds no more


def _most_plan_bytes(problem: Problem) -> float:
    """The most memory any plan may need, recomputing and regathering nothing: every piece's largest bytes (a
    group's of a finite cost, an edge's pair's, each fan-out item's), summed; the problem's counterpart of the
    graph's `autotp.cost.memory.most_bytes`. Where that fits the limit, no search under it can follow, and no
    model under it is built ahead."""
    groups = sum(max((b for b, c in zip(g.memory_bytes, g.cost_s) if math.isfinite(c)), default=0)
                 for g in problem.groups.values())
    edges = sum(max((max(row, default=0) for row in table), default=0) for table in problem.edge_memory.values())
    working = max((max(values) for values in problem.working.values()), default=0)  # inference's largest
    return groups + edges + working + sum(sum(f.memory_bytes) for f in problem.fanouts)


def _may_fit(problem: Problem, fixed: dict, limit: float, reduce: bool) -> bool:
    """False when even fractional choices of this branch (``fixed``: its recompute binaries) need more memory
    than ``limit``: the least-memory LP, a fraction of a second where proving the time LP infeasible can take
    the simplex minutes. Dead-end elimination keeps the least memory, so its relaxation bounds it from below."""
    lp, x = _model(problem, "memory", None, reduce)
    _fix(x, fixed)
    least = lp_relaxation_bound(lp)
    return least is None or least * _BYTES <= limit + abs(limit) * _BOUND_MARGIN  # a limit below 0 (tests) too


class _Search:
    """The branches of `_limited` solved so far: the best plan, whether a bound or ``cutoff`` beat any, the time
    spent, and the solve that stopped the search (a time limit, or a failed solver); ``found`` hears of each
    better plan a MIP proves, and of the opening set's completed plan near its bound (`solve`)."""

    def __init__(self, problem, limit, reduce, time_limit_s, solver, cutoff, found=None):
        self.problem, self.limit, self.reduce, self.time_limit_s, self.solver = problem, limit, reduce, time_limit_s, solver
        self.cutoff, self.best, self.last, self.failed, self.beaten, self.spent = cutoff, None, None, None, False, 0.0
        self.found = found

    def target(self) -> float | None:
        return self.best.objective_s if self.best is not None else self.cutoff

    def cutoff_now(self) -> float | None:
        """The target, less nothing a solver's tolerance could blur: what a relaxation or a MIP must beat."""
        target = self.target()
        return None if target is None else target * (1 + _BOUND_MARGIN)

    def skips(self, bound: float) -> bool:
        cutoff = self.cutoff_now()
        if cutoff is not None and bound >= cutoff:
            self.beaten = True
            return True
        return False

    def offer(self, branch: "_Branch") -> bool:
        """Take as the target the plan completed (`_completed`), or else rounded, from the branch's relaxation just
        solved (on its set's ILP), where it fits the limit and beats the target: a plan of the model, whose step
        time then cuts every relaxation and MIP after it (a MIP finds the best plan below it, or proves there is
        none). False where it does not fit or is no faster."""
        (lp, x), variant = branch.model, branch.variant
        recompute = _fixed_recompute(x, branch.fixed)
        if recompute is None:
            return False
        rounded, completed = _relaxation_plans(lp, x, self.solver, self.cutoff_now())
        choice = completed if completed is not None and memory_bytes(variant, completed, recompute) <= self.limit \
            else rounded
        if memory_bytes(variant, choice, recompute) > self.limit:
            return False
        seconds = step_time(variant, choice, recompute).total_s
        if not math.isfinite(seconds) or (self.target() is not None and seconds * _SCALE >= self.target()):
            return False
        self.best = Solution(choice, seconds * _SCALE, lp.n_vars, lp.n_rows, 0.0, "Optimal", solver=self.solver,
                             recompute=recompute, regather=branch.kinds)
        return True

    def report(self, bound: float) -> None:
        """Tell ``found`` of the opening set's offered plan, once all its branches are bounded, where it is within
        `_REPORT_WITHIN` of ``bound`` (their least): a lane handed a plan to beat further off searches longer than
        it waits. At batch 8 the plan is 0.09% above the bound and is told 2 s before the MIP proves the optimum;
        at batch 64 it is 1.7% above (1.1% above the optimum), and two counts searched against it took 1.5 s
        longer than against the optimum, told 2 s later."""
        if self.found is not None and self.best is not None and self.best.objective_s <= bound * (1 + _REPORT_WITHIN):
            self.found(self.best.objective_s / _SCALE)

    def solve(self, branch: "_Branch") -> None:
        if self.failed is not None:
            return
        cutoff = self.cutoff_now()
        last = self.last = _within(branch.variant, self.limit, self.reduce, self.time_limit_s, self.solver,
                                   fixed=branch.fixed, model=branch.model, cutoff=cutoff, duals=branch.duals)
        self.spent += last.solve_s
        if last.status in ("Infeasible", backends.CUT_OFF) and cutoff is not None:
            self.beaten = True  # no plan below the target: none at all, or none faster
        elif last.status == "Optimal" and self.cutoff is not None and last.objective_s >= self.cutoff * (1 - _BOUND_MARGIN):
            self.beaten = True
        elif last.status == "Optimal" and (self.best is None or last.objective_s < self.best.objective_s):
            self.best = replace(last, regather=branch.kinds)
            if self.found is not None:
                self.found(last.objective_s / _SCALE)
        elif last.status not in ("Optimal", "Infeasible"):
            self.failed = last  # stopped by the time limit, or the solver failed: say so

    def result(self) -> Solution:
        if self.best is None:
            if self.beaten or self.last is None:  # skipped by bounds, or every relaxation infeasible
                return Solution({}, math.inf, 0, 0, self.spent, "Beaten" if self.beaten else "Infeasible",
                                solver=self.solver)
            return self.last
        return replace(_effective(self.problem, self.best), solve_s=self.spent)


_MOST_BRANCHES = 4  # recompute binaries are branched on up to this many values (all of them, or none)


def _branches(x: dict) -> list[dict]:
    """Every value of the recompute binaries, as ``{(class, bit): 0 or 1}``; ``[{}]`` when there are none or
    more than `_MOST_BRANCHES` values (`recompute="layers"` counts each class's layers in several bits)."""
    bits = [(k, j) for k, (_, variables) in x.get(_RECOMPUTE, {}).items() for j in range(len(variables))]
    if not bits or 2 ** len(bits) > _MOST_BRANCHES:
        return [{}]
    return [dict(zip(bits, values)) for values in product((1, 0), repeat=len(bits))]


def _recomputed(x: dict, is_set) -> tuple[tuple[int, int], ...]:
    """``(class, layers)`` per class with layers recomputed (`Solution.recompute`), ``is_set(class, bit, variable)``
    saying which of its recompute binaries are 1."""
    counts = ((k, sum(size for j, (size, bit) in enumerate(zip(sizes, bits)) if is_set(k, j, bit)))
              for k, (sizes, bits) in x.get(_RECOMPUTE, {}).items())
    return tuple((k, n) for k, n in counts if n)


def _fixed_recompute(x: dict, fixed: dict) -> tuple | None:
    """What a branch recomputes (``fixed``: its recompute binaries), or None where it leaves one free."""
    if any((k, j) not in fixed for k, (_, bits) in x.get(_RECOMPUTE, {}).items() for j in range(len(bits))):
        return None
    return _recomputed(x, lambda k, j, bit: fixed[k, j])


def _fix(x: dict, fixed: dict) -> None:
    """Pin the recompute binaries named in ``fixed`` to their values (both bounds); a branch pins every one, so
    the same model serves each branch in turn."""
    for (k, j), value in fixed.items():
        variable = x[_RECOMPUTE][k][1][j]
        variable.model.set_bounds(variable.index, value, value)


def _within(problem: Problem, limit: float, reduce: bool, time_limit_s, solver: str, tries: int = 12,
            fixed: dict | None = None, model: tuple | None = None, cutoff: float | None = None,
            duals: Duals | None = None) -> Solution:
    """The fastest plan under the memory limit, checked in exact bytes (``fixed``: recompute binaries pinned;
    ``model``: the ILP under ``limit`` itself, already built; ``cutoff``: only plans below it are wanted, and
    ``"Infeasible"`` says there is none; ``duals``: that ILP's relaxation's, whose binaries proven above the
    cutoff are fixed to 0 (`autotp.solve.fixing`)).

    The solver meets each row to its tolerances (1e-6 of a MiB, and a binary
    may sit 1e-6 off its integer, which a large choice's bytes multiply), so
    a plan may exceed the limit by a few bytes or more; the row is then
    tightened by the excess, doubled at each try so that the solver's slack
    cannot keep the same plan, and solved again.
    """
    row = limit
    for attempt in range(tries):
        lp, x = model if model is not None and row == limit else _model(problem, "time", row, reduce)
        _fix(x, fixed or {})
        solution = _run_fixed(lp, x, time_limit_s, solver, cutoff, duals)
        if solution.status != "Optimal":
            return solution
        excess = memory_bytes(problem, solution.choice, solution.recompute) - limit
        if excess <= 0:
            return solution
        row -= excess * 2 ** attempt
    return replace(solution, status="Infeasible")


def _finish(solution: Solution, time_limit_s, earlier_s: float = 0.0) -> Solution:
    """The solution in seconds, or the error that says why there is none."""
    if solution.status != "Optimal":
        if time_limit_s is not None and solution.status == "Not Solved":
            raise SolverError(f"the ILP solver found no plan within time_limit_s={time_limit_s:g} s: raise the "
                              "time limit (or drop it)")
        raise SolverError(f"the ILP solver returned {solution.status!r}; try a longer time limit or fewer mesh axes")
    if solution.gap is not None:
        warn_gap(solution.gap, time_limit_s)
    return replace(solution, objective_s=solution.objective_s / _SCALE, solve_s=solution.solve_s + earlier_s)


def _pair_variables(lp, xu: dict, xv: dict, kept) -> dict:
    """Edge-pair variables and their row/column-sum constraints; only ``kept[i][j]`` pairs get one."""
    pairs = [(i, j) for i in xu for j in xv if kept[i][j]]
    y = dict(zip(pairs, lp.vars(len(pairs), zero_one=True)))
    by_row, by_column = {i: [] for i in xu}, {j: [] for j in xv}
    for (i, j), v in y.items():
        by_row[i].append(v.index)
        by_column[j].append(v.index)
    for ends, sums in ((xu, by_row), (xv, by_column)):
        for c, var in ends.items():
            lp.row(sums[c] + [var.index], [1.0] * len(sums[c]) + [-1.0], 0.0, 0.0)
    return y


def _terms(variables: dict, weights) -> Lin:
    """``sum(weights[key] * variables[key])`` over the keys of nonzero weight, as one expression."""
    keys = [key for key in variables if weights[key] != 0]
    return Lin([variables[key].index for key in keys], [float(weights[key]) for key in keys])


def _pair_terms(y: dict, table, scale: float) -> Lin:
    """``sum(table[i][j] * scale * y[i, j])`` over the pairs of nonzero ``table``, as one expression."""
    keys = [(i, j) for i, j in y if table[i][j] != 0]
    return Lin([y[key].index for key in keys], [table[i][j] * scale for i, j in keys])
