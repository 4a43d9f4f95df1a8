"""Run a function on N local processes joined by a gloo process group (tests, examples, verify)."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # N processes share this machine's cores: more threads than cores makes every timing noise
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return each rank's result.

    ``fn`` must be importable (defined at module level). A failure on any rank
    raises here with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
