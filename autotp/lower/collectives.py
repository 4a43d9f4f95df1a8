"""Collectives as autograd functions with the backward of DESIGN.md's table, wrapped as modules.

Each collective is torch's functional one (``torch.distributed._functional_collectives``):
an op that returns a new tensor, which ``torch.compile`` traces as it is and
eager mode runs on the process group's backend, waited for at once.

Each wrapper is an ``nn.Module`` without parameters, registered on the lowered
GraphModule under a readable name (``all_reduce_axis1``, ``all_gather_axis1_d2``), so
``print(local.code)`` shows every collective where it runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.lower.regather import tag, tagged


@dataclass
class CommCounter:
    """An opt-in tally of the collectives a lowered module issues: ``parallelize(..., counter=CommCounter())``.

    One record per collective call: ``(kind, mesh axis name, message bytes)``,
    bytes as nccl-tests count them (the all-reduce buffer, the gathered output,
    the full input of a reduce-scatter). Nothing is counted unless a counter is
    passed in, and each lowered module counts into its own object.
    """

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def record(self, kind: str, axis: str, message_bytes: int) -> None:
        self.calls.append((kind, axis, int(message_bytes)))

    @property
    def count(self) -> int:
        return len(self.calls)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.calls)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(kind for kind, _, _ in self.calls))

    def clear(self) -> None:
        self.calls.clear()


def count(comm, kind: str, message_bytes: int) -> None:
    """Record one collective on ``comm``'s axis when a counter was passed in. Nothing is counted while
    ``torch.compile`` traces the module (a list appended to inside autograd Functions breaks its graph):
    compiled, it issues the collectives of the eager module."""
    if getattr(comm, "counter", None) is not None and not torch.compiler.is_compiling():
        comm.counter.record(kind, comm.name, message_bytes)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group))


def _chunk(x: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    return x.chunk(n, dim=dim)[index].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def _identity(x: torch.Tensor, comm, dim) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce_on(x, comm, dim):
    count(comm, "all_reduce", _nbytes(x))
    return _all_reduce(x, comm.group)


def _gather_on(x, comm, dim):
    count(comm, "all_gather", _nbytes(x) * comm.size)
    return _gather(x, dim, comm.group)


def _chunk_on(x, comm, dim):
    return _chunk(x, dim, comm.size, comm.index)


def _reduce_scatter_on(x, comm, dim):
    count(comm, "reduce_scatter", _nbytes(x))
    return _reduce_scatter(x, dim, comm.group)


DUALS = {
    # kind: (forward, backward) -- DESIGN.md's table of autograd duals
    "all_reduce": (_all_reduce_on, _identity),  # P -> R; the gradient of a partial sum is replicated
    "grad_all_reduce": (_identity, _all_reduce_on),  # Megatron's f: R consumed by split work
    "all_gather": (_gather_on, _chunk_on),  # S(d) -> R; the gradient arriving is R: take this slice
    "all_gather_rs": (_gather_on, _reduce_scatter_on),  # S(d) -> R; the gradient arriving is partial
    "reduce_scatter": (_reduce_scatter_on, _gather_on),  # P -> S(d)
    "slice": (_chunk_on, _gather_on),  # R -> S(d)
    # pieces of a hierarchical gradient sum, run only inside a CollectiveChain (they change the gradient's shape)
    "grad_reduce_scatter": (_identity, _reduce_scatter_on),
    "grad_all_gather": (_identity, _gather_on),
}


class _CollectiveFn(torch.autograd.Function):
    """One collective on one mesh axis, with its dual run on the gradient in backward."""

    @staticmethod
    def forward(ctx, x, kind, comm, dim):
        ctx.kind, ctx.comm, ctx.dim = kind, comm, dim
        return DUALS[kind][0](x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return DUALS[ctx.kind][1](grad, ctx.comm, ctx.dim), None, None, None


def all_reduce_partial(x: torch.Tensor, comm) -> torch.Tensor:
    """P -> R with autograd: the sum over the axis; its gradient passes through unchanged."""
    return _CollectiveFn.apply(x, "all_reduce", comm, None)


class AxisComm:
    """One mesh axis as seen by this rank: its process group, size and this rank's index on it."""

    def __init__(self, name: str, size: int, index: int, group=None, counter: CommCounter | None = None):
        self.name, self.size, self.index, self._group = name, size, index, group
        self.counter = counter  # opt-in: see CommCounter

    @property
    def group(self):
        if self._group is None:
            raise RuntimeError(f"mesh axis {self.name!r} has no process group: this module was lowered for "
                               "inspection only; use autotp.parallelize inside an initialised process group")
        return self._group


class Collective(nn.Module):
    """A collective on one mesh axis, called from the lowered graph.

    ``regather``: what it returns is kept as its input and gathered again
    in backward (`autotp.lower.regather`); so is what any collective returns
    from such a tensor, the later steps of the same redistribution.
    """

    def __init__(self, kind: str, comm: AxisComm, dim: int | None = None, regather: bool = False):
        super().__init__()
        self.kind, self.comm, self.dim, self.regather = kind, comm, dim, regather

    def forward(self, x):
        out = _CollectiveFn.apply(x, self.kind, self.comm, self.dim)
        return tag(out, x, self) if self.regather or tagged(x) else out

    def run(self, x):
        """The forward collective alone, outside autograd: backward's rebuild of a regathered tensor."""
        return DUALS[self.kind][0](x, self.comm, self.dim)

    def extra_repr(self) -> str:
        dim = f", dim={self.dim}" if self.dim is not None else ""
        again = ", gathered again in backward" if self.regather else ""
        return f"{self.kind} on {self.comm.name} ({self.comm.size} ranks){dim}{again}"


class _ChainFn(torch.autograd.Function):
    """Several collectives as one autograd node: forwards in order, duals in reverse order.

    Needed where the pieces are not shape-preserving on their own: a gradient
    sum in hierarchical form is the identity forward and, backward, a
    reduce-scatter, an all-reduce of the piece and an all-gather.
    """

    @staticmethod
    def forward(ctx, x, links):
        ctx.links = links
        for kind, comm, dim in links:
            x = DUALS[kind][0](x, comm, dim)
        return x

    @staticmethod
    def backward(ctx, grad):
        for kind, comm, dim in reversed(ctx.links):
            grad = DUALS[kind][1](grad, comm, dim)
        return grad, None


class CollectiveChain(nn.Module):
    """Collectives on several mesh axes run as one unit (``links``: ``(kind, comm, dim)`` in forward order)."""

    def __init__(self, links):
        super().__init__()
        self.links = tuple(links)

    def forward(self, x):
        return _ChainFn.apply(x, self.links)

    def extra_repr(self) -> str:
        return "; ".join(f"{kind} on {comm.name}" + (f" dim={dim}" if dim is not None else "")
                         for kind, comm, dim in self.links)
