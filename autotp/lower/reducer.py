"""Gradient sums of data parallelism as DDP runs them: in buckets, launched as they fill, waited at the end.

A parameter whose only use takes it replicated on some mesh axes while the
use splits its work there gets a partial gradient on those axes (Megatron's
*f*, data parallelism's gradient all-reduce). The cost model calls such a use
*deferred* (`autotp.solve.problem.deferred_parameters`) and prices it on the
gradient chain (`autotp.solve.chain`); the lowering inserts nothing into the
graph for it and registers the parameter here instead, with the steps of its
sum (one all-reduce per axis, one flat all-reduce, or the hierarchical
reduce-scatter / all-reduce / all-gather: the plan's choice).

In backward, a hook on the parameter copies each arriving gradient into its
bucket (buckets of ``bucket_bytes``, DDP's 25 MiB by default, filled in the
order gradients become ready, one per kind of sum and dtype). A full bucket
starts its first collective at once, asynchronously; a sum of several steps
moves to its next step as soon as the last one is done (checked whenever
another gradient arrives). A callback queued on autograd's engine waits for
every bucket when the backward pass ends and gives each parameter its summed
gradient: ``param.grad`` becomes a view of the bucket (as DDP's
``gradient_as_bucket_view``) when the parameter had none, and the sum is added
to it when it had one (the hook then hands autograd zeros, so that only the
sum is added). The optimizer sees the same ``.grad`` as without buckets, and
gradients accumulate over several backward passes as they do on one device.

A sum is elementwise, so a bucket is one flat buffer whatever the layouts of
its members: a reduce-scatter cuts it in equal pieces (padded to a multiple of
the ranks) and the all-gather puts them back in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autotp.lower.collectives import count

_ASYNC = {
    "all_reduce": lambda out, x, group: dist.all_reduce(x, group=group, async_op=True),
    "reduce_scatter": lambda out, x, group: dist.reduce_scatter_single(out, x, group=group, async_op=True),
    "all_gather": lambda out, x, group: dist.all_gather_single(out, x, group=group, async_op=True),
}


@dataclass
class _Entry:
    param: torch.nn.Parameter
    name: str
    unit: tuple  # ((kind, AxisComm), ...) in the order they run
    position: int  # program position of the parameter's use: its gradient is ready after that op's backward


@dataclass
class _Bucket:
    """Members' gradients in one flat buffer, and the collective now running on it."""

    entries: list[_Entry]
    unit: tuple
    dtype: torch.dtype
    device: torch.device
    offsets: list[int] = field(default_factory=list)
    padded: int = 0
    arrived: set = field(default_factory=set)
    accumulate: set = field(default_factory=set)  # members that had a .grad already: the sum is added to it
    data: torch.Tensor | None = None
    step: int = -1  # the step running; len(unit) when summed
    work: object = None
    out: torch.Tensor | None = None

    def __post_init__(self):
        sizes = [e.param.numel() for e in self.entries]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        multiple = math.prod(comm.size for kind, comm in self.unit if kind == "reduce_scatter")
        self.padded = -(-self.offsets[-1] // multiple) * multiple

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.entries)

    def add(self, index: int, grad: torch.Tensor) -> bool:
        """Copy a member's arriving gradient in; True when its parameter already holds a ``.grad``."""
        if self.data is None:
            self.data = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.data[self.offsets[index]:self.offsets[index + 1]].copy_(grad.reshape(-1))
        self.arrived.add(index)
        if self.entries[index].param.grad is not None:
            self.accumulate.add(index)
            return True
        return False

    def advance(self, block: bool) -> None:
        """Start the next step once the running one is done; with ``block``, run every step to the end."""
        while self.step < len(self.unit):
            if self.work is not None:
                if not block and not self.work.is_completed():
                    return
                self.work.wait()
                self.work = None
                self.data = self.out if self.out is not None else self.data
            self.step += 1
            if self.step < len(self.unit):
                self._start(*self.unit[self.step])

    def _start(self, kind: str, comm) -> None:
        x = self.data
        size = {"all_reduce": x.numel(), "reduce_scatter": x.numel() // comm.size,
                "all_gather": x.numel() * comm.size}[kind]
        self.out = None if kind == "all_reduce" else torch.empty(size, dtype=x.dtype, device=x.device)
        count(comm, kind, (x if kind != "all_gather" else self.out).numel() * x.element_size())
        self.work = _ASYNC[kind](self.out, x, comm.group)

    def finish(self) -> None:
        """Wait for the sum and add each member's piece into its ``.grad``; ready for the next backward."""
        if self.step < 0:
            if not self.arrived:
                return
            self.advance(block=True)  # some members got no gradient this pass: sum the zeros too, as every rank does
        self.advance(block=True)
        for i, e in enumerate(self.entries):
            if i not in self.arrived:
                continue
            piece = self.data[self.offsets[i]:self.offsets[i + 1]].view_as(e.param)
            if i in self.accumulate:
                e.param.grad.add_(piece)
            else:  # autograd stored the partial gradient: the sum replaces it
                e.param.grad = piece
        self.arrived, self.accumulate, self.data, self.step, self.work, self.out = set(), set(), None, -1, None, None


@dataclass
class GradientReducer:
    """The buckets of one rank program; `autotp.lower.rewrite` registers parameters, hooks do the rest."""

    bucket_bytes: int
    entries: list[_Entry] = field(default_factory=list)
    buckets: list[_Bucket] = field(default_factory=list)
    _place: dict = field(default_factory=dict)  # entry index -> (bucket, index in bucket)
    _queued: bool = False

    def add(self, param: torch.nn.Parameter, name: str, unit: tuple, position: int) -> None:
        self.entries.append(_Entry(param, name, tuple(unit), position))

    def build(self) -> None:
        """Fill buckets in the order gradients become ready and hook every parameter."""
        open_buckets: dict[tuple, list[_Entry]] = {}
        order = sorted(range(len(self.entries)), key=lambda i: -self.entries[i].position)
        filled: list[tuple[tuple, list[int]]] = []
        for i in order:
            e = self.entries[i]
            key = (tuple((kind, comm.name) for kind, comm in e.unit), e.param.dtype, e.param.device)
            members = open_buckets.get(key)
            nbytes = sum(self.entries[j].param.numel() * self.entries[j].param.element_size() for j in members or [])
            if members is None or nbytes + e.param.numel() * e.param.element_size() > self.bucket_bytes:
                members = open_buckets[key] = []
                filled.append((key, members))
            members.append(i)
        for key, members in filled:
            first = self.entries[members[0]]
            bucket = _Bucket([self.entries[j] for j in members], first.unit, first.param.dtype, first.param.device)
            for k, j in enumerate(members):
                self._place[j] = (bucket, k)
            self.buckets.append(bucket)
        for i, e in enumerate(self.entries):
            e.param.register_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(grad: torch.Tensor):
            if self.ready(i, grad):
                return torch.zeros_like(grad)  # the sum is added into the existing .grad when backward ends
            return None  # autograd keeps the partial gradient; the sum replaces it when backward ends
        return hook

    def ready(self, i: int, grad: torch.Tensor) -> bool:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._queued = True
        bucket, k = self._place[i]
        accumulating = bucket.add(k, grad.detach())
        if bucket.full and bucket.step < 0:
            bucket.advance(block=False)
        for b in self.buckets:  # move multi-step sums along
            if 0 <= b.step < len(b.unit):
                b.advance(block=False)
        return accumulating

    def finish(self) -> None:
        self._queued = False
        for bucket in self.buckets:
            bucket.finish()

    def summary(self) -> list[tuple[int, int]]:
        """``(members, bytes)`` per bucket, in launch order."""
        return [(len(b.entries), b.offsets[-1] * torch.empty((), dtype=b.dtype).element_size()) for b in self.buckets]
