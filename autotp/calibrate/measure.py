"""Micro-benchmarks on the hardware at hand: matmul, memory copy, kernel launch, collectives.

Every rank runs every measurement at the same time, so a measurement sees the
contention the real program will see (4 processes on a 2-core machine share
its cores). Times are medians over repeats, after a warm-up, and the slowest
rank's time is taken (a collective is as slow as its slowest member).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_s(fn, device, repeats: int = 5, warmup: int = 1, group=None) -> float:
    """Median seconds of ``fn()`` over ``repeats``, the max across the ranks of ``group``.

    The ranks line up once, then run back to back as a program does, so the
    time includes the waiting for each other that real steps pay.
    """
    for _ in range(warmup):
        fn()
    if dist.is_initialized():
        dist.barrier(group=group)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median.item())


# a matmul that takes this long has amortised its launch long since, and a larger one only makes calibration slower:
# bfloat16 on a CPU without bfloat16 units runs at 1.2 GFLOP/s at 256 and 0.8 at 1024, where one matmul takes 2.6 s
# (six of them, with the warm-up: 16 s of every CPU calibration); on a GPU no size here comes near it
ENOUGH_S = 0.1


def matmul_flops(dtype: torch.dtype, device, sizes=(256, 512, 1024), enough_s: float = ENOUGH_S) -> float:
    """Best FLOP/s of a square matmul over ``sizes``, in order: the achievable peak for this dtype. The sizes
    stop at the first whose matmul takes ``enough_s`` or more; every rank stops at the same one, as each reads
    the slowest rank's time (`time_s`)."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = time_s(lambda: torch.mm(a, b), device, repeats=5)
        best = max(best, 2 * n ** 3 / seconds)
        if seconds >= enough_s:
            break
    return best


def memory_bandwidth_Bps(device, nbytes: int = 64 * 2 ** 20) -> float:
    """Bytes read plus written per second by a large tensor copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_s(lambda: dst.copy_(src), device, repeats=5)
    return 2 * nbytes / seconds


def launch_overhead_s(device, calls: int = 200) -> float:
    """Seconds per call of a one-element add: the fixed cost of running any op."""
    x = torch.ones(1, device=device)

    def run():
        for _ in range(calls):
            torch.add(x, x)

    return time_s(run, device, repeats=5) / calls


def _collective(kind: str, nbytes: int, n: int, group, device):
    """A closure running one collective whose nccl-tests message size is ``nbytes``."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    piece = torch.ones(numel // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, piece, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(piece, full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


def collective_time_s(kind: str, nbytes: int, n: int, group, device, repeats: int = 15) -> float:
    """Seconds one collective adds to a program.

    On a CPU the processes share cores, and a rank that waits in a collective
    competes with ranks still computing; so the collective is timed between
    bursts of compute (a small matmul) and the compute's own time subtracted.
    On a GPU it is timed on its own.
    """
    collective = _collective(kind, nbytes, n, group, device)
    if device.type != "cpu":
        return time_s(collective, device, repeats=repeats, group=group)
    a = torch.randn(160, 160, device=device)

    def load():
        for _ in range(8):
            torch.mm(a, a)

    def both():
        load()
        collective()

    alone = time_s(load, device, repeats=repeats, group=group)
    return max(time_s(both, device, repeats=repeats, group=group) - alone, 1e-6)
