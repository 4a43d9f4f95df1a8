"""Run a function on N local processes joined by a gloo process group (tests, examples, verify, calibrate).

Nothing hangs: the parent watches both the result queue and every child's
exit code. As soon as one rank raises, dies (``os._exit``, a segfault,
SIGKILL) or the whole run passes ``timeout_s``, the surviving ranks, which may
be blocked inside a collective waiting for the dead one, are terminated (then
killed) and `RankFailedError` names the rank that failed first and how. The
process group also gets a timeout, so a rank left alone in a collective gives
up on its own even without the parent.

The ranks are forked from the caller where that is safe, and spawned as
fresh interpreters otherwise (`start_method`): a fresh interpreter imports
torch again before it runs a line of ``fn``, some 2 s per rank on a 2-core
machine (four ranks of a trivial all-reduce: 8.3 s spawned, 0.4 s forked),
which the test suite paid at every one of its process groups.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue as queue_module
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autotp.errors import RankFailedError

_POLL_S = 0.05  # how often the parent looks at the queue and the exit codes
_DRAIN_S = 2.0  # after a clean exit, how long a result may still be in flight in the queue
_SETTLE_S = 1.0  # after a first failure, how long to wait for the others' reports (to find the cause)
_STOP_S = 3.0  # how long a survivor gets to exit after SIGTERM before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(world: int) -> int:
    """Intra-op threads per rank: N processes share this machine's cores, and more threads than cores makes
    every timing noise."""
    return max(1, (os.cpu_count() or 1) // world)


def start_method(world: int) -> str:
    """``"fork"`` where a forked rank runs as a spawned one would, else ``"spawn"``. Forking needs: the platform to
    have it; no CUDA initialised here (a forked child cannot use it); and one intra-op thread per rank, because
    torch's OpenMP thread pool does not survive a fork: a forked child that runs two threads hangs in its first
    parallel region (the parent having run one), where with one thread none is entered."""
    forkable = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
    return "fork" if forkable and _threads(world) == 1 else "spawn"


def _worker(rank, world, port, fn, args, queue, pg_timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(_threads(world))
    # a forked rank writes where a spawned one would, to the process's own streams, not to what the caller put
    # in their place (pytest's capture, a notebook's), which a child cannot use (faulthandler needs a file number)
    sys.stdout, sys.stderr = sys.__stdout__ or sys.stdout, sys.__stderr__ or sys.stderr
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # what ``fn`` built (modules holding process groups) goes while Python is whole: a gloo group left to
        # interpreter shutdown can abort the process ("terminate called without an active exception")
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def describe_exit(exitcode: int | None) -> str:
    """``exit code 3`` or ``signal SIGKILL``, as multiprocessing reports a child's end (negative = signal)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def spawn(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return each rank's result.

    ``fn`` must be importable (defined at module level). If any rank raises,
    dies, or the run is not done within ``timeout_s`` seconds, every other rank
    is stopped and `RankFailedError` names the failing rank, its exit code or
    signal, and its traceback when it had one. Collectives time out after
    ``timeout_s`` too, so no rank waits forever for a dead peer. A port taken
    between `free_port` and rank 0's store (by a process beside this one) is
    tried again on another, up to `_PORT_TRIES` runs in all.
    """
    for _ in range(_PORT_TRIES):
        results, failures = _spawn_once(fn, world_size, args, timeout_s)
        if not (failures and _port_taken(failures)):
            break
    if failures:
        raise RankFailedError(_failure_message(failures, world_size, timeout_s))
    return results


_PORT_TRIES = 3  # a free port is free when asked for; another process may bind it before rank 0's store does


def _port_taken(failures: dict) -> bool:
    """Whether the run failed because rank 0's store found its port taken: in `init_process_group`, before any
    rank ran ``fn`` (none gets past it without that store), so the run may start again on another port."""
    return any(kind == "raised" and "EADDRINUSE" in detail and "init_process_group" in detail
               for _, kind, detail in failures.values())


def _spawn_once(fn, world_size: int, args: tuple, timeout_s: float) -> tuple[list, dict]:
    ctx = mp.get_context(start_method(world_size))
    for stream in (sys.stdout, sys.stderr):  # a forked child would write what is still buffered here again
        stream.flush()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failures = None  # stays None if the parent itself is interrupted: then stop everyone at once
    try:
        results, failures = _watch(procs, queue, time.monotonic() + timeout_s)
    finally:
        _stop(procs, grace_s=_STOP_S if failures == {} else 0.0)
    return results, failures


def _watch(procs, queue, deadline: float) -> tuple[list, dict]:
    """Collect results until every rank reported; stop at the first failure (after a short settle)."""
    world = len(procs)
    results, done = [None] * world, set()
    failures: dict[int, tuple[float, str, str]] = {}  # rank -> (when, kind, detail)
    exited_at: dict[int, float] = {}
    settle_until = None
    while len(done) < world:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if now >= deadline:
            for rank in range(world):
                if rank not in done and rank not in failures:
                    failures[rank] = (now, "timeout", describe_exit(procs[rank].exitcode))
            break
        try:
            rank, status, value = queue.get(timeout=_POLL_S)
        except queue_module.Empty:
            pass
        else:
            if status == "ok":
                results[rank] = value
                done.add(rank)
            else:
                failures.setdefault(rank, (time.monotonic(), "raised", value))
        for rank, p in enumerate(procs):
            if rank in done or rank in failures or p.exitcode is None:
                continue
            first_seen = exited_at.setdefault(rank, time.monotonic())
            # a clean exit may still have its result in the queue's pipe; a non-zero one never reports
            if p.exitcode != 0 or time.monotonic() - first_seen > _DRAIN_S:
                failures[rank] = (first_seen, "died", describe_exit(p.exitcode))
        if failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S
    return results, failures


def _failure_message(failures: dict, world: int, timeout_s: float) -> str:
    """One line naming the cause, then each failed rank's detail (tracebacks last).

    A rank that died is reported before ranks that raised: when rank 1 is
    killed, rank 0's "connection closed" error is a consequence, not the cause.
    """
    order = {"died": 0, "raised": 1, "timeout": 2}
    ranked = sorted(failures.items(), key=lambda kv: (order[kv[1][1]], kv[1][0], kv[0]))
    rank, (_, kind, detail) = ranked[0]
    if kind == "died":
        head = (f"rank {rank} of {world} died ({detail}) without reporting a result; the other ranks were "
                "stopped. Look at that rank's output above for the cause (out of memory, a crash, a kill)")
    elif kind == "raised":
        last = detail.strip().splitlines()[-1] if detail.strip() else "an exception"
        head = f"rank {rank} of {world} raised {last}; the other ranks were stopped. Its traceback follows"
    else:
        waiting = sorted(r for r, f in failures.items() if f[1] == "timeout")
        head = (f"ranks {waiting} of {world} did not finish within {timeout_s:g} s and were stopped; "
                "raise timeout_s if the work is just slow, or look for a rank stuck in a collective")
    lines = [head]
    for r, (_, k, d) in ranked:
        lines.append(f"--- rank {r}: {k}" + (f" ({d})" if k != "raised" else f":\n{d.rstrip()}"))
    return "\n".join(lines)


def _stop(procs, grace_s: float) -> None:
    """Give children ``grace_s`` to exit, terminate the rest, kill those that ignore SIGTERM; reap all."""
    until = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, until - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    until = time.monotonic() + _STOP_S
    for p in procs:
        p.join(timeout=max(0.0, until - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=_STOP_S)
