"""The micro-batch counts `autotp.plan` tries, and what their searches add up to.

A count is searched in two halves (``job``, `autotp.api._CountJob`):
``prepare(k)`` captures the model at batch/k (or reads the graph off two
captures) and costs it, and ``solve(k, ..., beat_s)`` runs the ILP, cut
short by the plan to beat. The counts are searched in order here
(`search_in_order`), or side by side in forked processes
(`autotp.lanes.search_in_lanes`); either way a `Tally` adds up what they
give, and the plan is the fastest any count gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotp.errors import MemoryLimitError, PlanError
from autotp.mesh import Mesh
from autotp.solve.ilp import MemoryBinds, NoBetterPlan

# one micro-batch whose fastest plan needs this many times the memory limit is searched after `likely_count`:
# Llama-2-70B on 4x8 at batch 64 needs 20 times (it runs best as 16 micro-batches: 135 s of planning became 86),
# at batch 8 1.7 times (one micro-batch is best, and searching 2 first made planning 41 s -> 69 s)
DEFER_OVER = 4.0


def likely_count(counts: list[int], mesh: Mesh, batch: int | None) -> int | None:
    """The micro-batch count likeliest to win once memory binds: the most micro-batches that still give each
    data-parallel replica a sample (the mesh's axes but the last, conventionally the fast one that tensor
    parallelism takes, taken as data-parallel), Megatron-LM's micro-batch of one."""
    replicas = max(1, mesh.size // mesh.shape[-1])
    fitting = [k for k in counts if batch and (batch // k) % replicas == 0]
    return max(fitting, default=None)


def defers(counts: list[int], likely: int | None) -> bool:
    """Whether the first count may hand its search to `likely_count` (``solve(..., defer=True)``)."""
    return likely is not None and likely != counts[0]


def leads(counts: list[int], likely: int | None) -> bool:
    """Whether `likely_count` is searched first, at once (`lead_order`), rather than after one micro-batch
    defers to it: where it splits the batch into more than `DEFER_OVER` micro-batches, one micro-batch holds
    that many times its activations, and its fastest plan most likely needs more than `DEFER_OVER` times the
    limit (Llama-2-70B at batch 64 on 4x8: 16 micro-batches, and 20 times). One micro-batch is then neither
    captured nor bounded before the likeliest can start: lanes started its search 2 s sooner, and planning
    took 14.3 and 14.4 s where it took 15.9 and 16.1 s (`autotp.lanes`)."""
    return defers(counts, likely) and likely > DEFER_OVER


def lead_order(counts: list[int], likely: int) -> list[int]:
    """The counts in the order searched where the likeliest `leads`: it first, then the others nearest it first
    (at batch 64: 16, then 8 and 32, 4 and 64, 2, 1; its neighbours are the close calls)."""
    return [likely] + sorted((k for k in counts if k != likely), key=lambda k: distance(k, likely))


def distance(k: int, likely: int | None) -> tuple:
    """How far count ``k`` is from the likeliest, in factors of two (ties: the fewer micro-batches first)."""
    return (abs(math.log2(k / likely)) if likely else 0.0), k


@dataclass
class Tally:
    """What the counts searched so far give: the fastest plan, the ceiling no count above which can beat it,
    and why the count of fewest tokens per micro-batch that failed had no plan."""

    best: object = None  # Plan
    ceiling: float = math.inf
    failures: dict = field(default_factory=dict)  # count -> MemoryLimitError

    def target(self) -> float | None:
        """The step time a count must beat to matter."""
        return self.best.predicted["total_s"] if self.best is not None else None

    def planned(self, k: int, plan) -> None:
        if self.best is None or plan.predicted["total_s"] < self.best.predicted["total_s"]:
            self.best = plan
        if not plan.stats["memory_bound"]:
            self.ceiling = min(self.ceiling, k)  # the fastest plan of this k fits as it is: more only add steps

    def beaten(self, k: int, unlimited: bool) -> None:
        if unlimited:  # even unlimited, k micro-batches are slower than the best plan: more would be too
            self.ceiling = min(self.ceiling, k)

    def failed(self, k: int, error: MemoryLimitError) -> None:
        self.failures[k] = error  # fewer tokens per micro-batch may fit: the next k is tried

    def result(self):
        """The fastest plan, or the error of the count that came closest to fitting (the most micro-batches)."""
        if self.best is not None:
            return self.best
        if self.failures:
            raise self.failures[max(self.failures)]
        raise PlanError("no micro-batch count was searched; this is a bug, please report it")


def search_in_order(job, counts: list[int], likely: int | None, ahead: bool = False) -> Tally:
    """Each count in turn, the best plan so far the one to beat: in `lead_order` when ``ahead`` (the likeliest
    `leads`, and memory may bind at it); else from one micro-batch up, and when one micro-batch is far over the
    limit (`DEFER_OVER`), its costed problem waits while `likely_count` is searched first. The order changes the
    time the search takes (a good plan found early lets every later relaxation stop at it), never how fast the
    plan it finds is (of plans as fast, the one found first is kept)."""
    tally, pending, deferred = Tally(), lead_order(counts, likely) if ahead else list(counts), {}
    while pending:
        k = pending.pop(0)
        if k > tally.ceiling:
            continue
        captured, problem = deferred.pop(k) if k in deferred else job.prepare(k, job.stages)
        defer = not ahead and k == counts[0] and defers(counts, likely) and likely in pending
        try:
            settle(tally, k, _outcome(lambda: job.solve(k, captured, problem, tally.target(), defer, job.stages)))
        except MemoryBinds:
            deferred[k] = captured, problem
            pending.remove(likely)
            pending[:0] = [likely, k]
    return tally


def search_count(job, k: int, stages, first: bool, defer: bool, wait_for_target, found=None) -> tuple:
    """One count's search, as a lane runs it (`autotp.lanes`): prepared, then, unless it is the ``first``
    (searched without a plan to beat) or once it defers (`MemoryBinds`), handed the plan to beat by
    ``wait_for_target()``. ``("plan", plan)``, ``("beaten", unlimited)`` or ``("failed", error)``."""
    captured, problem = job.prepare(k, stages)
    beat = None if first else wait_for_target()
    try:
        return _outcome(lambda: job.solve(k, captured, problem, beat, defer, stages, found))
    except MemoryBinds:
        return _outcome(lambda: job.solve(k, captured, problem, wait_for_target(), False, stages, found))


def _outcome(solve) -> tuple:
    """``solve()``'s plan as a count's outcome (`settle`): ``("plan", plan)``, ``("beaten", unlimited)`` or
    ``("failed", error)``; `MemoryBinds` passes through."""
    try:
        return "plan", solve()
    except NoBetterPlan as exc:
        return "beaten", exc.unlimited
    except MemoryLimitError as exc:
        return "failed", exc


def settle(tally: Tally, k: int, outcome: tuple) -> None:
    """Add one count's outcome (`search_count`) to the tally."""
    kind, value = outcome
    if kind == "plan":
        tally.planned(k, value)
    elif kind == "beaten":
        tally.beaten(k, value)
    else:
        tally.failed(k, value)
