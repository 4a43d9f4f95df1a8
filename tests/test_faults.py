"""Faults: a rank that dies or hangs ends the run with an error naming it; interrupted writes keep the old file."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from autotp.errors import RankFailedError
from autotp.fileio import atomic_path, atomic_write_text
from autotp.runtime import spawn


def _stamp(path) -> None:
    """Record when this rank fails, so a test bounds the time to notice it, not the time to start processes."""
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _noticed_within(path) -> float:
    with open(path) as f:
        return time.time() - float(f.read())


def _fail_while_peer_waits(rank, world, how, stamp):
    """Rank 1 fails in its own way while rank 0 is blocked in an all_reduce that needs it."""
    if rank == 1:
        time.sleep(0.2)
        _stamp(stamp)
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


@pytest.mark.parametrize("how, detail", [("exit", "died (exit code 3)"), ("sigkill", "died (signal SIGKILL)")])
def test_failed_rank_stops_the_others(how, detail, tmp_path):
    with pytest.raises(RankFailedError) as info:
        spawn(_fail_while_peer_waits, 2, how, str(tmp_path / "died"))
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"rank 1 of 2 {detail}"), str(info.value)
    assert "other ranks were stopped" in first_line
    assert _noticed_within(tmp_path / "died") < 30  # a bound on "nothing hangs", not a speed test


def test_hung_rank_is_stopped_at_the_time_limit(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"did not finish within 4 s.*raise timeout_s") as info:
        spawn(_fail_while_peer_waits, 2, "hang", str(tmp_path / "hung"), timeout_s=4)
    assert "1" in str(info.value).splitlines()[0]
    assert time.monotonic() - start < 30  # 4 s, then SIGTERM and SIGKILL: never the hang's 600 s


def _calibrate_with_dying_rank(rank, world, out):
    """Calibration whose rank 1 dies in its first collective measurement, while rank 0 measures with it."""
    from autotp.calibrate import run

    if rank == 1:
        def die(*args, **kwargs):
            _stamp(os.path.join(out, "died"))
            os._exit(5)
        run.collective_time_s = die
    run.calibrate(name="dying", sizes=(4096, 16384), dtypes=(torch.float32,), repeats=2, out_dir=out,
                  progress=False)


def test_rank_dying_during_calibration(tmp_path):
    with pytest.raises(RankFailedError, match=r"^rank 1 of 2 died \(exit code 5\)"):
        spawn(_calibrate_with_dying_rank, 2, str(tmp_path))
    assert _noticed_within(tmp_path / "died") < 30
    assert not (tmp_path / "dying.json").exists()


def test_interrupted_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "plan.json"
    atomic_write_text(target, "previous")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("interrupted")
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"


spawn_module = importlib.import_module("autotp.runtime.spawn")  # the package's ``spawn`` is the function


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_port_taken_before_rank_0_binds_it_is_tried_again(monkeypatch):
    """The port `free_port` gave is taken by another process before rank 0's store listens on it (the race
    beside other test workers): the run starts again on another port, and its collectives run."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = spawn_module.free_port
    monkeypatch.setattr(spawn_module, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert spawn(_sum_of_ranks, 2, timeout_s=60) == [1.0, 1.0]
    finally:
        taken.close()
    assert not ports  # the taken port was handed out first


_SET_AT_RUN_TIME = {"value": None}  # a forked rank sees what the caller put here; a spawned one imports it afresh


def _how_started(rank, world):
    import faulthandler
    import sys

    faulthandler.enable()  # needs a real file number: a forked rank writes to the process's own streams
    faulthandler.disable()
    sys.stderr.write("")
    return _SET_AT_RUN_TIME["value"], torch.get_num_threads()


def test_ranks_are_forked_where_each_runs_one_thread_and_write_to_real_streams():
    """Forking skips importing torch again in every rank; it is taken only where a rank runs one intra-op thread
    (torch's OpenMP pool does not survive a fork), and a forked rank gets the process's streams, not pytest's
    capture, as a spawned rank would."""
    from autotp.runtime.spawn import start_method, _threads

    _SET_AT_RUN_TIME["value"] = "caller"
    try:
        seen = spawn(_how_started, 2)
    finally:
        _SET_AT_RUN_TIME["value"] = None
    forked = start_method(2) == "fork"
    assert forked == (_threads(2) == 1)
    assert seen == [("caller" if forked else None, _threads(2))] * 2
    assert start_method(1) == ("fork" if _threads(1) == 1 else "spawn")
