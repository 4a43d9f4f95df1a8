"""Micro-batch counts searched side by side: one forked process, a *lane*, per count.

`autotp.plan` tries several micro-batch counts (`autotp.counts`), and
each is a capture or a graph read off two, costing, and an ILP search:
Llama-2-70B on 4x8 spends 26 to 40 s so on one core. Threads cannot share
that work (the search's own Python and the costing's hold the GIL: a
thread preparing the next count slowed the whole plan down,
docs/planning-history.md), so each count runs in a process forked from the caller,
which holds the captures: the fork shares them, where a fresh process
would have to capture again (an `OpGraph` holds torch's operators, which
do not pickle).

The caller (the coordinator) captures for real what the lanes will read
other counts off, forks a lane per count, up to ``lanes`` working at once,
and relays between them:

* the first count is searched at once, with no plan to beat;
* every other count is prepared, then waits for a plan to beat: a search
  without one is the costliest of all (two micro-batches at batch 8 are
  not far from one, and no relaxation stops early). A branch's MIP that
  improves a lane's plan is reported as it is proven (``solve(...,
  found=)``), and so is the first set's plan completed from its relaxations
  when it is within half a percent of their bound (at batch 8, 2 s before
  the MIP proves the optimum, 0.04% above it), so the other lanes start
  long before the first finishes;
* when no lane is searching and none has a plan to beat (the first count
  deferred, `autotp.counts.DEFER_OVER`, or failed), the likeliest count
  (`autotp.counts.likely_count`) is let go without one.

Every lane's plan is the fastest of its count, or it is proven no faster
than the plan it was handed, so the plan chosen is the one the counts
searched in order give (`autotp.counts.search_in_order`), whatever the
timing; only plans within the solver's tolerance of each other could come
out either way. Progress lines come back whole, each prefixed with its
count. A lane that dies, or fails for a reason autotp does not raise on
purpose, is searched again in the caller, where the error has its full
traceback.

A count whose lane fails is settled no sooner than the counts below it: an
error at a count above the ceiling (`autotp.counts.Tally`) is dropped, as
that count could not have given the plan (and the search in order would
not have reached it: a model whose batch norm cannot take a micro-batch of
one sample plans at one micro-batch all the same).
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from dataclasses import dataclass
from multiprocessing.connection import wait

from autotp.cost.memory import AUTO
from autotp.counts import Tally, defers, distance, lead_order, search_count, settle
from autotp.errors import AutotpError, PlanError

PREPARING, WAITING, SEARCHING = "preparing", "waiting", "searching"
# how much less CPU a lane gets than the first count's and the likeliest's, where they share a core: every other
# count waits for a plan to beat, and one of those two finds it (the likeliest where the first defers, as at batch 64;
# with the likeliest at full priority too, batch 64 planned in 16.1 and 16.2 s against 17.2 and 17.6 s, and batch 8
# in 14.4 and 14.7 s against 15.6 and 15.6 s, back to back)
_NICER = 10


def lane_count(workers, counts: int) -> int:
    """How many lanes work at once: ``workers`` (an int), or with ``"auto"`` one per core this process may
    run on; never more than the counts, and one (the counts in order, in this process) where ``fork`` is
    missing (Windows), where this process may have none (a daemonic `multiprocessing` worker), or where
    there is one count."""
    if workers != AUTO and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise PlanError(f"workers={workers!r}: use 'auto' (one per core) or a positive int (1: no lanes)")
    if workers == AUTO:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 1
    return max(1, min(workers, counts))


@dataclass
class _Lane:
    k: int
    process: multiprocessing.Process
    conn: object  # the coordinator's end of the pipe
    state: str

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def search_in_lanes(job, counts: list[int], likely: int | None, lanes: int, ahead: bool = False) -> Tally:
    """The counts searched side by side (the module's docstring): a lane is started while fewer than ``lanes``
    prepare or search and no more than ``lanes`` wait, and every waiting lane is handed the plan to beat as soon
    as there is one. After the first count and the likeliest, the counts nearest the likeliest go first (at
    batch 64, 8 and 32 micro-batches before 2: the winner is 16, and its neighbours are the close calls). The
    tally is the one `autotp.counts.search_in_order` gives (``ahead``: the likeliest leads, as there)."""
    order, defer = lane_order(counts, likely, ahead)
    first = order[0]  # searched at once, with no plan to beat
    tally, reported = Tally(), None  # reported: the fastest plan a lane has proven so far, before its end
    pending, live = list(order), {}
    failed = {}  # count -> the AutotpError its lane raised, or None where it ended without an outcome
    try:
        while pending or live:
            target = min((t for t in (tally.target(), reported) if t is not None), default=None)
            _release(live, target, [likely] + order if likely else order, pending)
            # a lane waiting for a plan to beat holds its costed problem: up to ``lanes`` + 1 wait at once (with
            # ``lanes`` at most, Llama-2-70B at batch 64 planned in 19.5 s, not 17.9: a core idled)
            # with a plan to beat, what is left is work that waits on nothing: one lane more than the cores works,
            # so that the last counts start sooner and no core idles at the end
            busy = lanes + (target is not None)
            while pending and (_working(live) == 0 or _working(live) < busy and len(live) - _working(live) <= lanes):
                k = pending.pop(0)
                if k <= tally.ceiling:
                    live[k] = _fork(job, k, first=k == first, defer=defer and k == first,
                                    nice=k not in (first, likely))
            if not live:
                break  # every count left is above the ceiling
            for lane in _ready(live):
                reported = _hear(job, lane, live, tally, reported, failed)
            for k in [k for k in live if k > tally.ceiling]:  # a count above the ceiling cannot win
                live.pop(k).stop()
            _settle_failed(job, tally, failed, unsettled=set(live) | set(pending))
        _settle_failed(job, tally, failed, unsettled=set())
    finally:
        for lane in live.values():
            lane.stop()
    return tally


def lane_order(counts: list[int], likely: int | None, ahead: bool) -> tuple[list[int], bool]:
    """The order `search_in_lanes` starts the counts in, and whether the first may defer to the likeliest: with
    ``ahead`` the likeliest first (`autotp.counts.lead_order`); else the first count, the likeliest where the
    first defers to it, then the others nearest the likeliest first."""
    if ahead:
        return lead_order(counts, likely), False
    defer = defers(counts, likely)
    order = [counts[0]] + ([likely] if defer else [])
    return order + sorted((k for k in counts if k not in order), key=lambda k: distance(k, likely)), defer


def _working(live: dict) -> int:
    """Lanes preparing or searching (a waiting lane takes no CPU)."""
    return sum(lane.state != WAITING for lane in live.values())


def _release(live: dict, target: float | None, preference: list[int], pending: list[int]) -> None:
    """Hand every waiting lane the plan to beat; with none to beat and no lane searching, the first count of
    ``preference`` still to be searched, once it waits."""
    waiting = [k for k in live if live[k].state == WAITING]
    if target is None:
        if any(lane.state == SEARCHING for lane in live.values()):
            return
        k = next((k for k in preference if k in live or k in pending), None)
        waiting = [k] if k in waiting else []
    for k in waiting:
        live[k].conn.send(target)
        live[k].state = SEARCHING


def _fork(job, k: int, first: bool, defer: bool, nice: bool) -> _Lane:
    job.captures.capture_ahead(k)  # what lanes read other counts off is captured here, before they fork
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    process = context.Process(target=_lane, args=(theirs, job, k, first, defer, nice), name=f"autotp-lane-{k}",
                              daemon=True)
    process.start()
    theirs.close()
    return _Lane(k, process, mine, SEARCHING if first else PREPARING)


def _lane(conn, job, k: int, first: bool, defer: bool, nice: bool) -> None:
    """A lane's whole life: one count's search (`autotp.counts.search_count`), its progress and the plans it
    proves on the way sent back as they come, its outcome last; ``nice``: at a lower priority (`_NICER`)."""
    stages = job.stages_to(_Lines(conn, f"[{k} micro-batch{'es' if k > 1 else ''}] "))
    if nice:
        os.nice(_NICER)

    def wait_for_target():
        conn.send(("waiting",))
        return conn.recv()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each is warned again in the caller, under its filters
        try:
            outcome = search_count(job, k, stages, first, defer, wait_for_target,
                                   found=lambda seconds: conn.send(("found", seconds)))
        except AutotpError as exc:
            outcome = "error", exc
        except BaseException:  # noqa: BLE001 -- searched again in the caller, where it has its traceback
            outcome = "error", None
    for warning in caught:
        conn.send(("warning", warning.category, str(warning.message)))
    conn.send(outcome)
    conn.close()


class _Lines:
    """A lane's progress stream: each whole line goes to the coordinator, prefixed with the count."""

    def __init__(self, conn, prefix: str):
        self.conn, self.prefix, self.buffer = conn, prefix, ""

    def write(self, text: str) -> None:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self.conn.send(("line", f"{self.prefix}{line}\n"))

    def flush(self) -> None:
        pass


def _ready(live: dict) -> list[_Lane]:
    """The lanes with something to say, or that ended; blocks until one has."""
    by_handle = {}
    for lane in live.values():
        by_handle[lane.conn] = by_handle[lane.process.sentinel] = lane
    return list({id(by_handle[h]): by_handle[h] for h in wait(list(by_handle))}.values())


def _hear(job, lane: _Lane, live: dict, tally: Tally, reported: float | None, failed: dict):
    """Act on all a lane has sent; return the fastest plan proven so far. A lane that failed, or ended without
    an outcome (killed, or failed in a way that did not pickle), goes to ``failed`` (`_settle_failed`)."""
    while True:
        try:
            if not lane.conn.poll():
                if lane.process.is_alive():
                    return reported
                raise EOFError
            message = lane.conn.recv()
        except (EOFError, OSError):
            message = "error", None
        kind = message[0]
        if kind == "line":
            job.stages.write(message[1])
        elif kind == "waiting":
            lane.state = WAITING
        elif kind == "warning":
            warnings.warn(message[2], message[1], stacklevel=2)
        elif kind == "found":
            reported = message[1] if reported is None else min(reported, message[1])
        else:
            live.pop(lane.k).stop()
            if kind == "error":
                failed[lane.k] = message[1]
            else:
                settle(tally, lane.k, message)
            return reported


def _settle_failed(job, tally: Tally, failed: dict, unsettled: set) -> None:
    """Settle the failed counts whose fate no count still ``unsettled`` can change, fewest micro-batches first:
    one above the ceiling is dropped (it could not win), any other raises its lane's error, or, with none, is
    searched again here, where an error has its full traceback."""
    for k in sorted(failed):
        if k > tally.ceiling:
            del failed[k]
        elif any(j < k for j in unsettled):
            return  # a count below it may yet bring the ceiling under it
        else:
            error = failed.pop(k)
            if error is not None:
                raise error
            settle(tally, k, search_count(job, k, job.stages, False, False, tally.target))
