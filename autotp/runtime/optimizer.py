"""The optimizer of a rank module, with ZeRO-1 where the plan chose it: each device steps its slice.

A plan may split a parameter's optimizer state over the mesh axes where the
parameter itself is whole (``plan.optimizer_sharding``). Every device of such
a group holds the whole parameter and, after the gradient sums, the same
whole gradient. So each keeps, as the tensor the optimizer sees, only its
1/n slice of the flattened parameter (a view of its memory): before
the step it takes its slice of the gradient and frees the rest, the
optimizer updates the slice (and keeps Adam's moments for it alone), and one
all-gather over the group puts the updated parameter back together on every
device. An elementwise optimizer (SGD, Adam, AdamW, ...) computes exactly
what it computes on the whole parameter, so training is unchanged; one that
reads a whole tensor at once (a norm, as LAMB or Adafactor do) is not exact
this way.

``master_dtype`` keeps the slices in another dtype than the parameters, as
mixed-precision training does: bf16 parameters, fp32 master slices and
moments, the update cast back to bf16 before the all-gather. Parameters the
plan does not split this way go to the optimizer as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.lower.collectives import count


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
        self.numel = self.param.numel()
        self.size = -(-self.numel // n)  # every device's piece in the all-gather, the last one zero-padded
        self.start = min(index * self.size, self.numel)
        self.stop = min(self.start + self.size, self.numel)
        mine = self.param.detach().view(-1)[self.start:self.stop]
        self.shard = torch.nn.Parameter(mine if self.master_dtype is None else mine.to(self.master_dtype))
        self.shard.autotp_parameter = self.param  # checkpoints name the slice's state after its parameter

    def take_gradient(self) -> None:
        """The slice's gradient from the parameter's; the parameter's is freed."""
        grad = self.param.grad
        # a copy, not a view: the whole gradient's memory goes with .grad (and holds the all-gather that follows)
        self.shard.grad = None if grad is None else grad.reshape(-1)[self.start:self.stop].to(self.shard.dtype,
                                                                                             copy=True)
        self.param.grad = None

    def start_gather(self):
        """Start putting the updated parameter back together; ``(work, buffer)``, work None when there is none."""
        piece = torch.zeros(self.size, dtype=self.param.dtype, device=self.param.device)
        piece[:self.stop - self.start] = self.shard.detach()
        if self.comm is None:
            return None, piece
        out = torch.empty(self.size * self.comm.size, dtype=piece.dtype, device=piece.device)
        count(self.comm, "all_gather", out.numel() * out.element_size())
        return dist.all_gather_single(out, piece, group=self.comm.group, async_op=True), out

    def finish_gather(self, work, out: torch.Tensor) -> None:
        if work is not None:
            work.wait()
        with torch.no_grad():
            self.param.copy_(out[:self.numel].view_as(self.param))


def shard_optimizer(module, optimizer_class, *args, master_dtype: torch.dtype | None = None,
                    **kwargs) -> torch.optim.Optimizer:
    """``optimizer_class(params, *args, **kwargs)`` for a rank module, its state split as the plan says.

    Returns an ordinary ``torch.optim.Optimizer`` (learning-rate schedulers
    work); hooks around its ``step`` move each split parameter's gradient to
    its slice before and all-gather the parameter after. A split parameter's
    ``.grad`` is freed by ``step()``; its optimizer state is this device's
    slice (``state_dict()`` is per rank; `autotp.checkpoint.save_sharded` saves
    it under the parameters' names, for a resume under the same plan). On a plan without optimizer sharding
    and without ``master_dtype`` this is the plain optimizer.

        local = autotp.parallelize(model, plan)
        opt = autotp.runtime.shard_optimizer(local, torch.optim.AdamW, lr=1e-3)
        local(x).backward(); opt.step(); opt.zero_grad()
    """
    split = {id(p): comm for p, comm in getattr(module, "autotp_optimizer_shards", [])}
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
    if slices:
        optimizer.register_step_pre_hook(lambda *_: _take_gradients(slices))
        optimizer.register_step_post_hook(lambda *_: _gather(slices))
    return optimizer


def _take_gradients(slices: list[_Slice]) -> None:
    for s in slices:
        s.take_gradient()


def _gather(slices: list[_Slice]) -> None:
    """All-gather every updated parameter: started together, then waited in the same order on every rank."""
    pending = [(s, *s.start_gather()) for s in slices]
    for s, work, out in pending:
        s.finish_gather(work, out)
