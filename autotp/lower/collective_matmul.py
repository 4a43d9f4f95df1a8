"""Collective matmuls in the rank program: the ring forms whose overlap `autotp.cost.collective_matmul` credits.

Two rewrites of the rank graph, once its collectives are in place, when the
plan says so (``plan.runtime["overlap_tp"]``):

    all_gather_tp_d1(x) -> linear(g, w) -> ...        becomes  gather_matmul_linear(x, w)
    linear(x, w) -> reduce_scatter_tp_d1(p) -> ...    becomes  matmul_scatter_linear(x, w)

Two rings do all the work (`ring_gather`, `ring_reduce_scatter`): each step
sends one chunk to the next device on the axis and receives one from the
previous, and while it travels the matmul works on a chunk it already has.

* `GatherMatmul` gathers ``x`` with `ring_gather`, multiplying each chunk as
  it lands into one buffer, the gathered tensor (which the gathered tensor's
  other users read, and which is kept for backward, or regathered:
  `autotp.lower.regather`). Backward reduce-scatters the input's gradient
  with `ring_reduce_scatter`, computing each chunk's rows of it (and their
  share of the weight's gradient) while the previous chunk's sum travels; an
  all-gather whose gradient arrives whole takes only its own rows.
* `MatmulScatter` reduce-scatters its product with `ring_reduce_scatter`,
  computing each chunk's partial rows while the previous sum travels.
  Backward gathers the output's gradient with `ring_gather`, running the
  matmul's backward on each chunk as it lands.

Rows of a matmul along a dim that is not contracted are independent, so both
compute the same values (sums in another order: to rounding). In a recomputed
layer a collective matmul joins the checkpointed stretch of its matmul, so
recomputation runs its ring again (`autotp.lower.recompute`).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import fx, nn

from autotp.cost.collective_matmul import MATMULS, splits_rows
from autotp.lower.collectives import Collective, CollectiveChain, count
from autotp.lower.regather import tag, tagged
from autotp.redistribute import ALL_GATHER, ALL_GATHER_RS, REDUCE_SCATTER

aten = torch.ops.aten

FUSED = "autotp_fused"  # node meta: the matmul a collective matmul (or a piece of its result) stands for


def _shift(comm, send: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Send ``send`` to the next device on the axis; the buffer the previous one's lands in, and the transfers.

    The send and the receive go out as one batch: NCCL hangs on two devices that each send to and receive from
    the other in separate calls."""
    n, i = comm.size, comm.index
    incoming = torch.empty_like(send)
    return incoming, dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, group=comm.group, group_peer=(i + 1) % n),
        dist.P2POp(dist.irecv, incoming, group=comm.group, group_peer=(i - 1) % n)])


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def ring_gather(comm, mine: torch.Tensor, work) -> None:
    """Pass every device's chunk round the axis: ``work(index, chunk)`` runs on each, this device's first, while
    the next one travels."""
    n, index, held = comm.size, comm.index, mine.contiguous()
    for step in range(n):
        if step < n - 1:
            incoming, works = _shift(comm, held)
        work(index, held)
        if step < n - 1:
            _wait(works)
            held, index = incoming, (index - 1) % n


def ring_reduce_scatter(comm, partial) -> torch.Tensor:
    """The sum over the axis of this device's chunk, from ``partial(index)``: this device's share of chunk
    ``index``, computed while the running sum of the chunk before it travels."""
    n, i = comm.size, comm.index
    acc = partial((i - 1) % n).contiguous()
    for step in range(n - 1):  # the sum of chunk i - step - 1 goes on; that of chunk i - step - 2 arrives
        incoming, works = _shift(comm, acc)
        part = partial((i - step - 2) % n)
        _wait(works)
        acc = incoming.add_(part)
    return acc


def _weight_t(target, w: torch.Tensor) -> torch.Tensor:
    """The weight as ``[k, n]``: ``linear`` takes it as ``[n, k]``."""
    return w.t() if target == aten.linear.default else w


def _input_grad(target, grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return grad @ _weight_t(target, w).t()


def _weight_grad(target, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``x^T grad`` over every row (in ``linear``'s ``[n, k]`` layout for it)."""
    g = x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
    return g.t() if target == aten.linear.default else g


def _weight_grad_buffer(w: torch.Tensor) -> torch.Tensor:
    """Where the chunks' shares of the weight's gradient add up: in fp32 for a 16-bit weight, as one matmul
    would accumulate them."""
    return torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))


def _as_weight(grad: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(w.dtype)


def _chunk(x: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    return x.narrow(dim, index * (x.shape[dim] // n), x.shape[dim] // n)


class _GatherMatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, module):
        gather = module.gather
        comm, dim = gather.comm, gather.dim
        size = x.shape[dim]
        shape = list(x.shape)
        shape[dim] *= comm.size
        full = x.new_empty(shape)
        products = [None] * comm.size

        def land(index, chunk):
            full.narrow(dim, index * size, size).copy_(chunk)
            products[index] = module.target(chunk, w)

        ring_gather(comm, x, land)
        if gather.regather or tagged(x):
            tag(full, x, gather)  # kept as the shard: backward gathers it again
        ctx.module = module
        ctx.save_for_backward(full, w)
        out = torch.cat(products, dim)
        return (out, full) if module.shared else out

    @staticmethod
    def backward(ctx, grad, grad_full=None):
        full, w = ctx.saved_tensors
        grad = grad.to(full.dtype)  # under autocast the product came out in another dtype
        module = ctx.module
        gather, target = module.gather, module.target
        comm, dim, n = gather.comm, gather.dim, gather.comm.size
        if gather.kind == ALL_GATHER_RS:  # the gradient arrives partial: sum it over the axis as a ring
            weight_grad = _weight_grad_buffer(w) if ctx.needs_input_grad[1] else None

            def rows(index):  # this chunk's input gradient, and its share of the weight's
                g = _chunk(grad, dim, n, index)
                if weight_grad is not None:
                    weight_grad.add_(_weight_grad(target, _chunk(full, dim, n, index), g))
                own = _input_grad(target, g, w)
                return own if grad_full is None else own + _chunk(grad_full, dim, n, index)

            count(comm, "reduce_scatter", full.numel() * full.element_size())
            return ring_reduce_scatter(comm, rows), _as_weight(weight_grad, w), None
        # it arrives whole: nothing to hide, this device's rows of the input's gradient and one weight gradient
        own = _chunk(grad, dim, n, comm.index)
        x_grad = _input_grad(target, own, w) if ctx.needs_input_grad[0] else None
        if x_grad is not None and grad_full is not None:
            x_grad = x_grad + _chunk(grad_full, dim, n, comm.index)
        return x_grad, _weight_grad(target, full, grad) if ctx.needs_input_grad[1] else None, None


class GatherMatmul(nn.Module):
    """``target(all_gather(x), w)``, the gather a ring and the matmul run on each chunk as it lands.

    Returns the product, and with ``shared`` the gathered tensor too, for its other users.
    """

    def __init__(self, gather: Collective, target, shared: bool):
        super().__init__()
        self.gather, self.target, self.shared = gather, target, shared

    def forward(self, x, w):
        count(self.gather.comm, "all_gather", x.numel() * x.element_size() * self.gather.comm.size)
        return _GatherMatmulFn.apply(x, w, self)

    def extra_repr(self) -> str:
        return f"{self.gather.extra_repr()}, as a ring with {getattr(self.target, '__name__', self.target)}"


class _MatmulScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, module):
        comm, dim = module.scatter.comm, module.scatter.dim
        ctx.module = module
        ctx.save_for_backward(x, w)
        return ring_reduce_scatter(comm, lambda index: module.target(_chunk(x, dim, comm.size, index), w))

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(x.dtype)  # under autocast the product came out in another dtype
        module = ctx.module
        comm, dim, n, target = module.scatter.comm, module.scatter.dim, module.scatter.comm.size, module.target
        count(comm, "all_gather", grad.numel() * grad.element_size() * n)
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        weight_grad = _weight_grad_buffer(w) if ctx.needs_input_grad[1] else None

        def land(index, g):  # the matmul's backward on one chunk of rows
            if x_grad is not None:
                _chunk(x_grad, dim, n, index).copy_(_input_grad(target, g, w))
            if weight_grad is not None:
                weight_grad.add_(_weight_grad(target, _chunk(x, dim, n, index), g))

        ring_gather(comm, grad, land)
        return x_grad, _as_weight(weight_grad, w), None


class MatmulScatter(nn.Module):
    """``reduce_scatter(target(x, w))`` over the scatter's dim, as a ring that adds each chunk's rows on its way."""

    def __init__(self, scatter: Collective, target):
        super().__init__()
        self.scatter, self.target = scatter, target

    def forward(self, x, w):
        out_bytes = x.numel() // x.shape[-1] * w.numel() // x.shape[-1] * x.element_size()
        count(self.scatter.comm, "reduce_scatter", out_bytes)
        return _MatmulScatterFn.apply(x, w, self)

    def extra_repr(self) -> str:
        return f"{self.scatter.extra_repr()}, as a ring with {getattr(self.target, '__name__', self.target)}"


def _ndim(node) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _matmul_by_rows(node, dim: int) -> bool:
    return (node.op == "call_function" and node.target in MATMULS and len(node.args) == 2
            and splits_rows(node.target, _ndim(node.args[0]), _ndim(node.args[1]), dim))


def fuse_collective_matmuls(gm: fx.GraphModule, partial=frozenset()) -> int:
    """Turn each all-gather into a matmul and each reduce-scatter of one into collective matmuls; how many.

    ``partial``: the matmuls whose product is a partial sum. Each matmul hides one collective, and the cost model
    credits such a matmul's reduce-scatter, not a gather into it (`autotp.cost.collective_matmul`)."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, Collective) or module.comm.size < 2 or module.dim is None:
            continue
        if module.kind in (ALL_GATHER, ALL_GATHER_RS):
            fused += _fuse_gather(gm, node, module, partial)
        elif module.kind == REDUCE_SCATTER:
            fused += _fuse_scatter(gm, node, module)
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _is_collective(gm, node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_module"
            and isinstance(gm.get_submodule(node.target), (Collective, CollectiveChain)))


def _first_user(node):
    after = node.next
    while after.op != "root" and after not in node.users:
        after = after.next
    return after if after.op != "root" else None


def _fuse_gather(gm, node, module, partial) -> bool:
    users, first = list(node.users), _first_user(node)
    if (first is None or not _matmul_by_rows(first, module.dim) or first.args[0] is not node or first.kwargs
            or node in first.args[1:] or first.name in partial
            or _is_collective(gm, node.args[0])):  # one collective is the whole redistribution, as priced
        return False
    name = f"gather_matmul_{first.name}"
    gm.add_submodule(name, GatherMatmul(module, first.target, shared=len(users) > 1))
    graph = gm.graph
    with graph.inserting_before(first):
        call = graph.call_module(name, (node.args[0], *first.args[1:]))
        call.meta = {FUSED: first.name}
        if len(users) > 1:
            product = graph.call_function(operator.getitem, (call, 0))
            gathered = graph.call_function(operator.getitem, (call, 1))
            product.meta, gathered.meta = {**first.meta, FUSED: first.name}, {**node.meta, FUSED: first.name}
            node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not first)
        else:
            product = call
            call.meta = {**first.meta, FUSED: first.name}
    first.replace_all_uses_with(product)
    graph.erase_node(first)
    graph.erase_node(node)
    return True


def _fuse_scatter(gm, node, module) -> bool:
    matmul = node.args[0]
    if (not isinstance(matmul, fx.Node) or not _matmul_by_rows(matmul, module.dim) or len(matmul.users) != 1
            or matmul.kwargs or any(_is_collective(gm, user) for user in node.users)):
        return False  # the redistribution must be this one collective, as priced
    name = f"matmul_scatter_{matmul.name}"
    gm.add_submodule(name, MatmulScatter(module, matmul.target))
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, tuple(matmul.args))
    call.meta = {**node.meta, FUSED: matmul.name}
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    gm.graph.erase_node(matmul)
    return True


__all__ = ["GatherMatmul", "MatmulScatter", "fuse_collective_matmuls", "FUSED"]
