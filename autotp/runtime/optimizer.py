"""The optimizer of a rank module, with ZeRO-1 and 2 where the plan chose them: each device steps its slice.

A plan may split a parameter's optimizer state over the mesh axes where the
parameter itself is whole (``plan.optimizer_sharding``, ZeRO-1). Every
device of such a group holds the whole parameter and, after the gradient
sums, the same whole gradient. So each keeps, as the tensor the optimizer
sees, only its 1/n slice of the flattened parameter (a view of its memory):
before the step it takes its slice of the gradient and frees the rest, the
optimizer updates the slice (and keeps Adam's moments for it alone), and one
all-gather over the group puts the updated parameter back together on every
device. With the gradient split as well (``plan.gradient_sharding``, ZeRO-2)
the reducer's reduce-scatter leaves each device only its slice of the summed
gradient (`autotp.lower.reducer`), and the step takes that instead of
``.grad``, which stays empty. An elementwise optimizer (SGD, Adam, AdamW,
...) computes exactly what it computes on the whole parameter, so training
is unchanged; one that reads a whole tensor at once (a norm, as LAMB or
Adafactor do, or ``clip_grad_norm_``) is not exact this way.

``master_dtype`` keeps the slices in another dtype than the parameters, as
mixed-precision training does: bf16 parameters, fp32 master slices and
moments, the update cast back to bf16 before the all-gather. Parameters the
plan does not split this way go to the optimizer as they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.lower.collectives import count
from autotp.lower.dtensor import local_grad, local_tensor
from autotp.lower.pending import landed, wait_parameters


@dataclass
class _Slice:
    """This device's slice of one parameter, as the optimizer's own tensor.

    Without ``master_dtype`` the slice is a view of the parameter's memory,
    so it never goes stale (a checkpoint loaded into the parameter is in the
    slice too); with it, a copy in that dtype, made once.
    """

    param: torch.nn.Parameter
    comm: object  # AxisComm of the group the state is split over, or None to keep the whole (a master copy)
    master_dtype: torch.dtype | None = None

    def __post_init__(self):
        n, index = (self.comm.size, self.comm.index) if self.comm is not None else (1, 0)
        self.local = local_tensor(self.param)  # the shard of a DTensor parameter (`autotp.lower.dtensor`)
        self.numel = self.local.numel()
        self.size = -(-self.numel // n)  # every device's piece in the all-gather, the last one zero-padded
        self.start = min(index * self.size, self.numel)
        self.stop = min(self.start + self.size, self.numel)
        mine = self.local.detach().view(-1)[self.start:self.stop]
        self.shard = torch.nn.Parameter(mine if self.master_dtype is None else mine.to(self.master_dtype))
        self.shard.autotp_parameter = self.param  # checkpoints name the slice's state after its parameter

    def take_gradient(self) -> None:
        """The slice's gradient from the parameter's (or from the reducer's slice, ZeRO-2); the parameter's is freed."""
        sliced = getattr(self.param, "autotp_gradient_slice", None)
        if sliced is not None:
            self.shard.grad = sliced[:self.stop - self.start].to(self.shard.dtype, copy=True)
            self.param.autotp_gradient_slice = self.param.grad = None
            return
        grad = local_grad(self.param)
        # a copy, not a view: the whole gradient's memory goes with .grad (and holds the all-gather that follows)
        self.shard.grad = None if grad is None else grad.reshape(-1)[self.start:self.stop].to(self.shard.dtype,
                                                                                             copy=True)
        self.param.grad = None

    def start_gather(self):
        """Start putting the updated parameter back together; ``(work, buffer)``, work None when there is none.

        The all-gather writes straight into the parameter when its slices
        tile it exactly (no padding), so a pending gather holds no copy.
        """
        piece = torch.zeros(self.size, dtype=self.local.dtype, device=self.local.device)
        piece[:self.stop - self.start] = self.shard.detach()
        if self.comm is None:
            return None, piece
        n = self.comm.size
        direct = self.size * n == self.numel and self.local.is_contiguous()
        out = self.local.detach().view(-1) if direct else torch.empty(self.size * n, dtype=piece.dtype,
                                                                       device=piece.device)
        count(self.comm, "all_gather", out.numel() * out.element_size())
        return dist.all_gather_single(out, piece, group=self.comm.group, async_op=True), out

    def finish_gather(self, work, out: torch.Tensor) -> None:
        if work is not None:
            work.wait()
        if out.data_ptr() != self.local.data_ptr():
            with torch.no_grad():
                self.local.copy_(out[:self.numel].view_as(self.local))


def shard_optimizer(module, optimizer_class, *args, master_dtype: torch.dtype | None = None,
                    **kwargs) -> torch.optim.Optimizer:
    """``optimizer_class(params, *args, **kwargs)`` for a rank module, its state split as the plan says.

    Returns an ordinary ``torch.optim.Optimizer`` (learning-rate schedulers
    work); hooks around its ``step`` move each split parameter's gradient to
    its slice before and all-gather the parameter after. Under a plan that
    overlaps its collectives (the default) those all-gathers run behind the
    next forward pass, which waits for each parameter at its first use: read
    parameters between the step and the next forward pass only after
    ``autotp.runtime.wait_parameters(module)`` (``state_dict()`` and
    `autotp.checkpoint` call it). A split parameter's
    ``.grad`` is freed by ``step()``; its optimizer state is this device's
    slice (``state_dict()`` is per rank; `autotp.checkpoint.save_sharded` saves
    it under the parameters' names, for a resume under the same plan). On a plan without optimizer sharding
    and without ``master_dtype`` this is the plain optimizer.

        local = autotp.parallelize(model, plan)
        opt = autotp.runtime.shard_optimizer(local, torch.optim.AdamW, lr=1e-3)
        local(x).backward(); opt.step(); opt.zero_grad()
    """
    shards = getattr(module, "autotp_optimizer_shards", [])
    split = {id(p): comm for p, comm in shards}
    slices, params = [], []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if id(p) in split or master_dtype is not None:
            slices.append(_Slice(p, split.get(id(p)), master_dtype))
            params.append(slices[-1].shard)
        else:
            params.append(p)
    optimizer = optimizer_class(params, *args, **kwargs)
    prefetch = getattr(module, "autotp_prefetch", False)
    if slices:
        rank = {id(p): i for i, (p, _) in enumerate(shards)}  # the order the next forward pass first uses them
        slices.sort(key=lambda s: rank.get(id(s.param), len(rank)))
        optimizer.register_step_pre_hook(lambda *_: _take_gradients(slices))
        optimizer.register_step_post_hook(lambda *_: _gather(slices, prefetch))
    if prefetch and split:  # a state_dict() between the step and the next forward must see the gathered values
        module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: wait_parameters(m))
    reducer = getattr(module, "autotp_reducer", None)
    if reducer is not None and any(s.comm is not None for s in slices):
        reducer.keep_slices = True  # ZeRO-2 sums stay sliced: the step reads them (`_Slice.take_gradient`)
        optimizer.zero_grad = _clearing_slices(optimizer.zero_grad, slices)
    return optimizer


def _clearing_slices(zero_grad, slices: list[_Slice]):
    """``optimizer.zero_grad`` that also drops ZeRO-2 gradient slices not yet stepped."""
    def clear(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)
        for s in slices:
            s.param.autotp_gradient_slice = None
    return clear


def _take_gradients(slices: list[_Slice]) -> None:
    for s in slices:
        landed(s.param)  # a parameter no forward pass used since the last step: its gather lands before the update
        s.take_gradient()


def _gather(slices: list[_Slice], prefetch: bool) -> None:
    """All-gather every updated parameter, started together in first-use order on every rank.

    With ``prefetch`` each split parameter's gather is left pending, and the
    next forward pass waits for it just before the parameter's first use
    (`autotp.lower.pending`); otherwise every one is waited here.
    """
    pending = [(s, *s.start_gather()) for s in slices]
    for s, work, out in pending:
        if prefetch and work is not None:
            s.param.autotp_pending = functools.partial(s.finish_gather, work, out)
        else:
            s.finish_gather(work, out)
