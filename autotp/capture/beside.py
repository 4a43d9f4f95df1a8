"""A capture made in a forked process while this one makes another: the second core's work at a plan's start.

Where memory binds, `autotp.plan` captures the model at two micro-batch
sizes and reads every other count's graph off them (`autotp.graph.resize`),
and the lanes that search the counts (`autotp.lanes`) start as the captures
they need are made. One capture after the other, the second core idled
through the first: 1.9 s of Llama-2-70B at batch 64. So the second is made
in a process forked before the first starts, and its `OpGraph` comes back
through a pipe, pickled with torch's operators by name (an `OpOverload` does
not pickle).

What comes back is the graph and what the capture said (its progress
line, its time, and what it replayed); the module stays behind, as for a
graph read off two (`autotp.api.Captured`: the first capture's module
stands for it). A capture that fails or dies here is made again by the
caller, where its error has its full traceback.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle

import torch


class Beside:
    """``capture()`` (a `Captured`, its progress lines and its seconds) run in a process forked now; `result`
    waits for what comes back of it."""

    def __init__(self, capture):
        context = multiprocessing.get_context("fork")
        self.conn, theirs = context.Pipe(duplex=False)
        self.process = context.Process(target=_run, args=(theirs, capture), name="autotp-capture", daemon=True)
        self.process.start()
        theirs.close()

    def result(self):
        """``(graph, lines, seconds, report)`` of the capture, or None where it failed or its process died."""
        try:
            payload = self.conn.recv_bytes()
        except (EOFError, OSError):
            payload = b""
        self.stop()
        return pickle.loads(payload) if payload else None

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _run(conn, capture) -> None:
    try:
        captured, lines, seconds = capture()
        payload = dumps((captured.graph, lines, seconds, captured.gm.meta["autotp_capture"]))
    except BaseException:  # noqa: BLE001 -- made again by the caller, where the error has its traceback
        payload = b""
    conn.send_bytes(payload)
    conn.close()


def dumps(value) -> bytes:
    """``value`` pickled, torch's operators by name."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _operator, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def _operator(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
