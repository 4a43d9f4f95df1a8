"""Collectives as autograd functions with the backward of DESIGN.md's table, wrapped as modules.

Each wrapper is an ``nn.Module`` without parameters, registered on the lowered
GraphModule under a readable name (``all_reduce_tp``, ``all_gather_tp_d2``), so
``print(local.code)`` shows every collective where it runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _gather(x: torch.Tensor, dim: int, group, n: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(x: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    return x.chunk(n, dim=dim)[index].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, group, n: int) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim)


class _AllReduceFn(torch.autograd.Function):
    """P -> R. Backward: nothing, the gradient of a partial sum is the replicated gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGatherFn(torch.autograd.Function):
    """S(d) -> R. Backward: this device's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _gather(x, dim, comm.group, comm.size)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, ctx.dim, ctx.comm.size, ctx.comm.index), None, None


class _AllGatherRSFn(torch.autograd.Function):
    """S(d) -> R when the gradient coming back is partial. Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _gather(x, dim, comm.group, comm.size)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.comm.group, ctx.comm.size), None, None


class _ReduceScatterFn(torch.autograd.Function):
    """P -> S(d). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, dim, comm.group, comm.size)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.comm.group, ctx.comm.size), None, None


class _ShardFn(torch.autograd.Function):
    """R -> S(d): a local slice. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _chunk(x, dim, comm.size, comm.index)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.comm.group, ctx.comm.size), None, None


class _GradAllReduceFn(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the partial gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm.group), None


class AxisComm:
    """One mesh axis as seen by this rank: its process group, size and this rank's index on it."""

    def __init__(self, name: str, size: int, index: int, group=None):
        self.name, self.size, self.index, self._group = name, size, index, group

    @property
    def group(self):
        if self._group is None:
            raise RuntimeError(f"mesh axis {self.name!r} has no process group: this module was lowered for "
                               "inspection only; use autotp.parallelize inside an initialised process group")
        return self._group


class Collective(nn.Module):
    """A collective on one mesh axis, called from the lowered graph."""

    def __init__(self, kind: str, comm: AxisComm, dim: int | None = None):
        super().__init__()
        self.kind, self.comm, self.dim = kind, comm, dim

    def forward(self, x):
        if self.kind == "all_reduce":
            return _AllReduceFn.apply(x, self.comm)
        if self.kind == "grad_all_reduce":
            return _GradAllReduceFn.apply(x, self.comm)
        fn = {"all_gather": _AllGatherFn, "all_gather_rs": _AllGatherRSFn, "reduce_scatter": _ReduceScatterFn,
              "slice": _ShardFn}[self.kind]
        return fn.apply(x, self.comm, self.dim)

    def extra_repr(self) -> str:
        dim = f", dim={self.dim}" if self.dim is not None else ""
        return f"{self.kind} on {self.comm.name} ({self.comm.size} ranks){dim}"
