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
order gradients become ready, one per kind of sum, dtype and device, formed
at the first backward pass and again whenever a parameter's dtype or device
changed). A full bucket starts its first collective at once,
asynchronously. A callback queued on autograd's engine waits for every
bucket when the backward pass ends and gives each parameter its summed
gradient: ``param.grad`` becomes a view of the bucket (as DDP's
``gradient_as_bucket_view``) when the parameter had none, and the sum is
added to it when it had one. So the optimizer sees the same ``.grad`` as
without buckets, gradients accumulate over several backward passes as on one
device, and a parameter's partial gradient is freed as soon as it is copied.

The collectives here are c10d's in-place ones with work handles, as DDP's
reducer issues them: they sum into the bucket's own storage, whose slots are
the parameters' ``.grad`` views, from hooks that run outside any compiled
graph (the program's own collectives are functional ones,
`autotp.lower.collectives`).

Every rank must issue the same collectives on a group in the same order.
Hooks fire in the same order on every rank (the program is the same), so
collectives are only ever started at those points: a bucket's first step
when it fills, and the next step of a sum of several steps (a hierarchical
one) when a later bucket fills, after waiting for the step before; the rest
at the end of the backward pass, bucket by bucket.

Micro-batches (`autotp.runtime.accumulate`): inside ``no_sync()`` a backward
pass sums nothing but the ZeRO-2 gradients (below); each other parameter's
partial gradient accumulates in ``.grad`` (as DDP's ``no_sync``), which is a
view of its slot in its bucket from the first such pass on (DDP's
``gradient_as_bucket_view``). The first backward pass after it adds the new
partial gradient into that slot, so the sum over ranks is taken once, of
every micro-batch's, and the accumulated gradients are never held twice
(a bucket and ``.grad`` beside it). Gradients must be zero (``None``) when
the first ``no_sync`` pass starts. A ZeRO-2 gradient is summed in every
pass instead, so its whole gradient never outlives one backward pass: its
slices accumulate (DeepSpeed's ZeRO-2), at the price of one reduce-scatter
per micro-batch, which the cost model charges (`autotp.solve.chain`).

Gradients reach ``.grad`` when ``backward()`` returns: use ``.backward()``.
``torch.autograd.grad`` on the parameters of a rank module would see the
partial gradients (as with DDP, which does not support it either).

A sum is elementwise, so a bucket is one flat buffer whatever the layouts of
its members: a reduce-scatter cuts it in equal pieces (padded to a multiple of
the ranks) and the all-gather puts them back in the same order.

ZeRO-2 (``plan.gradient_sharding``): a sum that ends in a reduce-scatter
into the optimizer's slices (`GRADIENT_SLICE`) lays its bucket out by
device, not by member: device ``r``'s piece holds slice ``r`` of every member
(each member's flattened gradient cut in ``n`` slices of ``ceil(numel / n)``,
the last zero-padded, as `autotp.runtime.optimizer` cuts the parameter), so
the reduce-scatter leaves each device exactly its slices, summed. With an
optimizer from `autotp.runtime.shard_optimizer` attached (``keep_slices``),
a member's slice goes to ``param.autotp_gradient_slice`` and ``.grad`` stays
empty: the whole gradient never outlives its bucket. Without one, an
all-gather puts the sum back together into ``.grad``, so a plain optimizer
(or a gradient check) sees what it would see without ZeRO-2.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autotp.lower.collectives import count
from autotp.lower.dtensor import local_grad, local_tensor, set_local_grad

GRADIENT_SLICE = "gradient_slice"  # ZeRO-2's reduce-scatter of a summed gradient into the optimizer's slices
_ASYNC = {
    "all_reduce": lambda out, x, group: dist.all_reduce(x, group=group, async_op=True),
    "reduce_scatter": lambda out, x, group: dist.reduce_scatter_single(out, x, group=group, async_op=True),
    GRADIENT_SLICE: lambda out, x, group: dist.reduce_scatter_single(out, x, group=group, async_op=True),
    "all_gather": lambda out, x, group: dist.all_gather_single(out, x, group=group, async_op=True),
}


def _sliced(unit: tuple) -> bool:
    """Whether a sum's steps end in ZeRO-2's reduce-scatter: summed in every pass, ``no_sync`` or not."""
    return bool(unit) and unit[-1][0] == GRADIENT_SLICE


@dataclass
class _Entry:
    param: torch.nn.Parameter  # plain, or a DTensor: the buckets hold its local gradient (`autotp.lower.dtensor`)
    unit: tuple  # ((kind, AxisComm), ...) in the order they run
    position: int  # program position of the parameter's use: its gradient is ready after that op's backward

    @property
    def local(self) -> torch.Tensor:
        return local_tensor(self.param)


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
        multiple = math.prod(comm.size for kind, comm in self.unit if kind == "reduce_scatter")
        self.slices = self.unit[-1][1].size if _sliced(self.unit) else 1
        # a member's piece of a device's part: its whole gradient, or (ZeRO-2) one of its n slices
        sizes = [-(-e.local.numel() // self.slices) for e in self.entries]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.padded = -(-self.offsets[-1] // multiple) * multiple * self.slices  # one part per device

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.entries)

    @property
    def started(self) -> bool:
        return self.step >= 0

    def _by_device(self, data: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s ``n`` slices in a buffer laid out by device: an ``(n, slice)`` view."""
        return data.view(self.slices, -1)[:, self.offsets[index]:self.offsets[index + 1]]

    def slot(self, index: int) -> torch.Tensor:
        """Member ``index``'s whole gradient in the buffer (one slice per member: no ZeRO-2), allocated with it."""
        if self.data is None:
            self.data = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        return self.data[self.offsets[index]:self.offsets[index + 1]]

    def add(self, index: int, grad: torch.Tensor, onto: bool = False) -> bool:
        """Copy a member's arriving gradient in (``onto``: add it to what its slot holds, the partial gradients
        of ``no_sync`` passes); True when its parameter already holds a ``.grad``."""
        flat = grad.reshape(-1)
        if self.slices > 1:
            self.slot(index)
            whole = self._by_device(self.data, index)
            flat = torch.nn.functional.pad(flat, (0, whole.numel() - flat.numel()))
            whole.copy_(flat.view(self.slices, -1))
        elif onto:
            self.slot(index).add_(flat)
        else:
            self.slot(index).copy_(flat)
        self.arrived.add(index)
        if self.entries[index].param.grad is not None:
            self.accumulate.add(index)
            return True
        return False

    def next_step(self) -> None:
        """Wait for the running step (if any) and start the next one; nothing once summed."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.data = self.out if self.out is not None else self.data
        if self.step < len(self.unit):
            self.step += 1
        if self.step < len(self.unit):
            self._start(*self.unit[self.step])

    def _start(self, kind: str, comm) -> None:
        x = self.data
        size = {"all_reduce": x.numel(), "reduce_scatter": x.numel() // comm.size,
                GRADIENT_SLICE: x.numel() // comm.size, "all_gather": x.numel() * comm.size}[kind]
        self.out = None if kind == "all_reduce" else torch.empty(size, dtype=x.dtype, device=x.device)
        counted = "reduce_scatter" if kind == GRADIENT_SLICE else kind
        count(comm, counted, (x if kind != "all_gather" else self.out).numel() * x.element_size())
        self.work = _ASYNC[kind](self.out, x, comm.group)

    def finish(self, keep_slices: bool = False) -> None:
        """Run the sum to its end and give each member its piece; ready for the next backward.

        A ZeRO-2 bucket gives each member its optimizer slice with
        ``keep_slices``, else all-gathers the slices back into whole gradients.
        """
        if not self.arrived:
            return  # no member had a gradient this pass, on any rank (the program is the same)
        while self.step < len(self.unit):  # some members got no gradient: their zeros are summed too
            self.next_step()
        if self.slices > 1 and keep_slices:
            self._keep_slices()
        else:
            self._give_whole()
        self.arrived, self.accumulate, self.data, self.step, self.work, self.out = set(), set(), None, -1, None, None

    def _keep_slices(self) -> None:
        comm = self.unit[-1][1]
        for i, e in enumerate(self.entries):
            if i not in self.arrived:
                continue
            piece = self.data[self.offsets[i]:self.offsets[i + 1]]
            if i in self.accumulate:  # a whole .grad left from before the slices were kept: its slice joins the sum
                size = self.offsets[i + 1] - self.offsets[i]
                whole = torch.nn.functional.pad(local_grad(e.param).reshape(-1), (0, size * self.slices - e.local.numel()))
                piece = piece + whole.view(self.slices, size)[comm.index]
                e.param.grad = None
            held = getattr(e.param, "autotp_gradient_slice", None)
            e.param.autotp_gradient_slice = piece if held is None else held.add_(piece)

    def _give_whole(self) -> None:
        data = self.data
        if self.slices > 1:  # this device's slices: gather every device's back into the by-device layout
            kind, comm = self.unit[-1]
            data = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            count(comm, "all_gather", data.numel() * data.element_size())
            dist.all_gather_single(data, self.data, group=comm.group)
        for i, e in enumerate(self.entries):
            if i not in self.arrived:
                continue
            if self.slices > 1:
                piece = self._by_device(data, i).reshape(-1)[:e.local.numel()].view_as(e.local)
            else:
                piece = data[self.offsets[i]:self.offsets[i + 1]].view_as(e.local)
            if i in self.accumulate:
                local_grad(e.param).add_(piece)
            else:  # the partial gradient was dropped when copied: the sum takes its place
                set_local_grad(e.param, piece)


@dataclass
class GradientReducer:
    """The buckets of one rank program; `autotp.lower.rewrite` registers parameters, hooks do the rest."""

    bucket_bytes: int
    entries: list[_Entry] = field(default_factory=list)
    buckets: list[_Bucket] = field(default_factory=list)
    _place: dict = field(default_factory=dict)  # entry index -> (bucket, index in bucket)
    _layout: tuple = ()  # the members' dtypes and devices the buckets were formed for
    _task: int | None = None  # the backward pass whose end is queued
    _started: list = field(default_factory=list)  # buckets started in this pass, in order
    _unsynced: set = field(default_factory=set)  # entries whose .grad holds partial gradients of no_sync passes
    syncing: bool = True  # False inside no_sync(): gradients accumulate unsummed
    keep_slices: bool = False  # ZeRO-2 sums stay sliced for `autotp.runtime.shard_optimizer`'s optimizer

    def add(self, param: torch.nn.Parameter, unit: tuple, position: int) -> None:
        self.entries.append(_Entry(param, tuple(unit), position))

    def hook(self) -> None:
        """Hook every registered parameter: its gradient goes to a bucket as it arrives."""
        for i, e in enumerate(self.entries):
            e.param.register_hook(self._arrive(i))
            e.param.register_post_accumulate_grad_hook(self._drop(i))

    def _form_buckets(self) -> None:
        """Fill buckets in the order gradients become ready: one sum kind, dtype and device each, up to the cap."""
        self.buckets, self._place = [], {}
        filling: dict[tuple, list[int]] = {}
        sizes: dict[tuple, int] = {}
        for i in sorted(range(len(self.entries)), key=lambda i: -self.entries[i].position):
            p = self.entries[i].local
            key = (tuple((kind, comm.name) for kind, comm in self.entries[i].unit), p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if key not in filling or sizes[key] + nbytes > self.bucket_bytes:
                filling[key], sizes[key] = [], 0
                self.buckets.append(filling[key])
            filling[key].append(i)
            sizes[key] += nbytes
        self.buckets = [self._bucket(members) for members in self.buckets]
        self._layout = tuple((e.local.dtype, e.local.device) for e in self.entries)

    def _bucket(self, members: list[int]) -> _Bucket:
        first = self.entries[members[0]]
        bucket = _Bucket([self.entries[j] for j in members], first.unit, first.local.dtype, first.local.device)
        for k, j in enumerate(members):
            self._place[j] = (bucket, k)
        return bucket

    def _ensure_buckets(self) -> None:
        """Buckets for the members' dtypes and devices as they are now: formed again when one changed."""
        if self._layout != tuple((e.local.dtype, e.local.device) for e in self.entries):
            self._form_buckets()

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate partial gradients in ``.grad``; the next one outside sums them all."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def _arrive(self, i: int):
        def hook(grad: torch.Tensor):
            if not self.syncing and not _sliced(self.entries[i].unit):
                return self._hold(i, grad)
            if self.ready(i, grad):
                return torch.zeros_like(grad)  # the sum is added into the existing .grad when backward ends
            return None  # autograd stores it, `_drop` frees it, the sum takes its place when backward ends
        return hook

    def _hold(self, i: int, grad: torch.Tensor) -> None:
        """A no_sync pass: autograd accumulates the partial gradient into ``.grad``, a view of the parameter's
        slot in its bucket (DDP's ``gradient_as_bucket_view``), so the pass that sums finds it in place and
        the gradients are never held twice."""
        if i in self._unsynced:
            return None
        param = self.entries[i].param
        if param.grad is not None:
            raise RuntimeError("gradients must be zero before accumulating micro-batches without a sum: call "
                               "optimizer.zero_grad() (or set .grad to None) before the first no_sync pass")
        self._ensure_buckets()
        bucket, k = self._place[i]
        set_local_grad(param, bucket.slot(k).view_as(self.entries[i].local))  # zeros: autograd adds into it
        self._unsynced.add(i)
        return None

    def _drop(self, i: int):
        def hook(param: torch.nn.Parameter) -> None:
            if i in self._unsynced:
                return  # a no_sync pass: the partial gradient stays in .grad until the pass that sums
            bucket, k = self._place[i]
            if k not in bucket.accumulate:
                param.grad = None  # a copy is in the bucket
        return hook

    def ready(self, i: int, grad: torch.Tensor) -> bool:
        """A gradient arrived: into its bucket; a full bucket starts, and older sums of several steps move on."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first gradient of this backward pass
            self._ensure_buckets()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._task, self._started = task, []
        bucket, k = self._place[i]
        held = i in self._unsynced  # earlier micro-batches' partial gradients, in the slot: this one joins them
        if held:
            self._unsynced.discard(i)
            self.entries[i].param.grad = None  # the slot's view; the sum takes its place when backward ends
        accumulating = bucket.add(k, local_tensor(grad).detach(), onto=held)
        if bucket.full and not bucket.started:
            for older in self._started:
                if older.step < len(older.unit) - 1:  # a step is left after the running one
                    older.next_step()
            bucket.next_step()
            self._started.append(bucket)
        return accumulating

    def finish(self) -> None:
        self._task = None
        for bucket in self.buckets:
            bucket.finish(self.keep_slices)
        if self._unsynced and self.syncing:  # gradients from no_sync passes, none in this one: never summed
            names = len(self._unsynced)
            self._unsynced.clear()
            raise RuntimeError(f"{names} parameter(s) got gradients in no_sync passes but none in the backward pass "
                               "that sums them: every micro-batch must differentiate the same outputs")
