"""Collective matmuls in the rank program: the ring forms whose overlap `autotp.cost.collective_matmul` credits.

Two rewrites of the rank graph, once its collectives are in place, when the
plan says so (``plan.runtime["overlap_tp"]``):

    all_gather_tp_d1(x) -> linear(g, w) -> ...        becomes  gather_matmul_linear(x, w)
    (and linear(g, w2), linear(g, w3) join it: gather_matmul_linear(x, w, w2, w3))
    linear(x, w) -> reduce_scatter_tp_d1(p) -> ...    becomes  matmul_scatter_linear(x, w)

Two rings do all the work (`ring_gather`, `ring_reduce_scatter`): each step
sends one chunk to the next device on the axis and receives one from the
previous, and while it travels the matmul works on a chunk it already has.

* `GatherMatmul` gathers ``x`` with `ring_gather` for every matmul that reads
  the gathered tensor by its rows (a layer's q, k and v: one ring), each
  multiplying each chunk as it lands, into one buffer, the gathered tensor
  (which its other users read, if any, and which is kept for backward).
  Backward reduce-scatters the input's gradient with `ring_reduce_scatter`,
  computing each chunk's rows of it (and their share of the weights'
  gradients) while the previous chunk's sum travels; an all-gather whose
  gradient arrives whole takes only its own rows. Regathered
  (`autotp.lower.regather`) with no other reader, it keeps only the shard,
  and backward's ring carries the chunks again beside the sums
  (`ring_gather_reduce_scatter`): the weights' gradient shares run on each
  as it lands.
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


def _shift(comm, *sends: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """Send each of ``sends`` to the next device on the axis; the buffers the previous one's land in, and the
    transfers.

    The sends and the receives go out as one batch, matched in order: NCCL hangs on two devices that each send
    to and receive from the other in separate calls."""
    n, i = comm.size, comm.index
    incoming = [torch.empty_like(send) for send in sends]
    ops = [dist.P2POp(dist.isend, send, group=comm.group, group_peer=(i + 1) % n) for send in sends]
    ops += [dist.P2POp(dist.irecv, buf, group=comm.group, group_peer=(i - 1) % n) for buf in incoming]
    return incoming, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def ring_gather(comm, mine: torch.Tensor, work) -> None:
    """Pass every device's chunk round the axis: ``work(index, chunk)`` runs on each, this device's first, while
    the next one travels."""
    n, index, held = comm.size, comm.index, mine.contiguous()
    for step in range(n):
        if step < n - 1:
            (incoming,), works = _shift(comm, held)
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
        (incoming,), works = _shift(comm, acc)
        part = partial((i - step - 2) % n)
        _wait(works)
        acc = incoming.add_(part)
    return acc


def ring_gather_reduce_scatter(comm, mine: torch.Tensor, work, partial) -> torch.Tensor:
    """`ring_gather` and `ring_reduce_scatter` at once, one batch of transfers a step: ``work(index, chunk)``
    on every device's chunk of ``mine`` as it lands, and the sum of this device's chunk of ``partial``.

    Backward of a regathered collective matmul: the input's chunks come round again for the weight's gradient
    while the input gradient's sums go round, both behind the matmul's backward."""
    n, i = comm.size, comm.index
    held, index = mine.contiguous(), i
    acc = partial((i - 1) % n).contiguous()
    for step in range(n - 1):
        (incoming, summed), works = _shift(comm, held, acc)
        work(index, held)
        part = partial((i - step - 2) % n)
        _wait(works)
        held, index, acc = incoming, (index - 1) % n, summed.add_(part)
    work(index, held)
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
    def forward(ctx, x, module, *ws):
        gather = module.gather
        comm, dim = gather.comm, gather.dim
        size = x.shape[dim]
        shape = list(x.shape)
        shape[dim] *= comm.size
        full = x.new_empty(shape)
        products = [[None] * comm.size for _ in ws]

        def land(index, chunk):
            full.narrow(dim, index * size, size).copy_(chunk)
            for k, (target, w) in enumerate(zip(module.targets, ws)):
                products[k][index] = target(chunk, w)

        ring_gather(comm, x, land)
        again = gather.regather or tagged(x)
        if again:
            tag(full, x, gather)  # kept as the shard: backward gathers it again
        # the ring of backward gathers it again itself when the matmuls are its only readers; a recomputed one
        # rebuilds it by running this forward again instead (`autotp.lower.recompute`)
        ctx.ring_again = again and not module.shared and not module.recomputed
        ctx.module = module
        ctx.save_for_backward(x if ctx.ring_again else full, *ws)
        outs = [torch.cat(p, dim) for p in products] + ([full] if module.shared else [])
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        held, *ws = ctx.saved_tensors  # the gathered input, or with ring_again this device's shard of it
        module = ctx.module
        gather, targets = module.gather, module.targets
        comm, dim, n = gather.comm, gather.dim, gather.comm.size
        grad_full = grads[len(ws)] if module.shared else None
        grads = [None if g is None else g.to(held.dtype) for g in grads[:len(ws)]]  # autocast: another dtype
        wanted = [ctx.needs_input_grad[2 + k] and g is not None for k, g in enumerate(grads)]
        chunk_shape = list(held.shape)
        if not ctx.ring_again:
            chunk_shape[dim] //= n
        again = ctx.ring_again and any(wanted)  # only the weights' gradients read the gathered input

        def input_rows(index):  # chunk ``index`` of the input's gradient, summed over the matmuls
            total = grad_full.narrow(dim, index * chunk_shape[dim], chunk_shape[dim]) if grad_full is not None \
                else held.new_zeros(chunk_shape)
            for target, g, w in zip(targets, grads, ws):
                if g is not None:
                    total = total + _input_grad(target, _chunk(g, dim, n, index), w)
            return total

        if gather.kind == ALL_GATHER_RS or again:
            weight_grads = [_weight_grad_buffer(w) if want else None for w, want in zip(ws, wanted)]

            def shares(index, rows):  # the weights' gradients over one chunk of the gathered input's rows
                for target, g, wg in zip(targets, grads, weight_grads):
                    if wg is not None:
                        wg.add_(_weight_grad(target, rows, _chunk(g, dim, n, index)))

            if gather.kind == ALL_GATHER_RS:  # the gradient arrives partial: sum it over the axis as a ring
                count(comm, "reduce_scatter", held.numel() * held.element_size() * (n if ctx.ring_again else 1))
                if again:
                    count(comm, "all_gather", held.numel() * held.element_size() * n)
                    x_grad = ring_gather_reduce_scatter(comm, held, shares, input_rows)
                else:
                    def rows(index):  # this chunk's input gradient, and its share of the weights'
                        shares(index, _chunk(held, dim, n, index))
                        return input_rows(index)
                    x_grad = ring_reduce_scatter(comm, rows)
            else:  # the gradient arrives whole: this device's rows of it, while the shards come round again
                count(comm, "all_gather", held.numel() * held.element_size() * n)
                x_grad = None

                def land(index, rows):
                    nonlocal x_grad
                    if x_grad is None and ctx.needs_input_grad[0]:
                        x_grad = input_rows(comm.index)
                    shares(index, rows)

                ring_gather(comm, held, land)
            return (x_grad, None, *(_as_weight(wg, w) for wg, w in zip(weight_grads, ws)))
        # it arrives whole (and was kept, or no weight wants it): this device's rows of the input's gradient
        x_grad = input_rows(comm.index) if ctx.needs_input_grad[0] else None
        return (x_grad, None, *(_weight_grad(target, held, g) if want else None
                                for target, g, want in zip(targets, grads, wanted)))


class GatherMatmul(nn.Module):
    """``target(all_gather(x), w)`` for each matmul reading the gathered tensor: the gather a ring, and every
    matmul run on each chunk as it lands.

    Returns the products (one tensor, or a tuple), and with ``shared`` the
    gathered tensor too, for its other users. ``recomputed``: it runs in a
    checkpointed stretch (`autotp.lower.recompute`).
    """

    def __init__(self, gather: Collective, targets, shared: bool):
        super().__init__()
        self.gather, self.targets, self.shared, self.recomputed = gather, tuple(targets), shared, False

    def forward(self, x, *ws):
        if torch.compiler.is_compiling():  # rings of point-to-point sends do not trace: one all-gather, then the matmuls
            full = self.gather(x)
            outs = [target(full, w) for target, w in zip(self.targets, ws)] + ([full] if self.shared else [])
            return tuple(outs) if len(outs) > 1 else outs[0]
        count(self.gather.comm, "all_gather", x.numel() * x.element_size() * self.gather.comm.size)
        return _GatherMatmulFn.apply(x, self, *ws)

    def extra_repr(self) -> str:
        names = ", ".join(getattr(t, "__name__", str(t)) for t in self.targets)
        return f"{self.gather.extra_repr()}, as a ring with {names}"


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
        if torch.compiler.is_compiling():  # rings of point-to-point sends do not trace: the matmul, one reduce-scatter
            return self.scatter(self.target(x, w))
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
    """Fuse ``node``'s gather with its first user, a matmul by rows, and with every later user that is one too,
    so that backward's ring serves them all (`_GatherMatmulFn`); the gathered tensor is shared only with the
    users left (none: a regathered input is then gathered again by that ring alone)."""
    users, first = list(node.users), _first_user(node)
    if (first is None or not _fusable(first, node, module, partial)
            or _is_collective(gm, node.args[0])):  # one collective is the whole redistribution, as priced
        return False
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    fused = [first] + [u for u in users if u is not first and _fusable(u, node, module, partial)
                       and _hoisted(gm, u.args[1:], first, order)]
    name = f"gather_matmul_{first.name}"
    left = [u for u in users if u not in fused]
    gm.add_submodule(name, GatherMatmul(module, [u.target for u in fused], shared=bool(left)))
    graph = gm.graph
    with graph.inserting_before(first):
        call = graph.call_module(name, (node.args[0], *(u.args[1] for u in fused)))
        call.meta = {FUSED: first.name}
        if len(fused) == 1 and not left:
            call.meta = {**first.meta, FUSED: first.name}
            outs = [call]
        else:
            outs = [graph.call_function(operator.getitem, (call, k)) for k in range(len(fused) + bool(left))]
            for out, user in zip(outs, fused):
                out.meta = {**user.meta, FUSED: first.name}
    if left:
        outs[-1].meta = {**node.meta, FUSED: first.name}
        node.replace_all_uses_with(outs[-1], delete_user_cb=lambda user: user not in fused)
    for user, out in zip(fused, outs):
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def _fusable(user, node, module, partial) -> bool:
    """Whether ``user`` multiplies the gathered ``node`` by rows of its gathered dim, and nothing else of it."""
    return (_matmul_by_rows(user, module.dim) and user.args[0] is node and not user.kwargs
            and node not in user.args[1:] and user.name not in partial)


_MOVABLE = (Collective, CollectiveChain)


def _hoisted(gm, args, before, order: dict) -> bool:
    """Whether every node in ``args`` is computed before ``before``, moving the collectives that gather a weight
    (and nothing they read is later) up to it; False, and nothing moved, when one cannot be. ``order``: each
    node's position in the graph before any move (a moved node only comes earlier, never past ``before``)."""
    late = [a for a in args if isinstance(a, fx.Node) and order[a] > order[before]]
    movable = all(a.op == "call_module" and isinstance(gm.get_submodule(a.target), _MOVABLE)
                  and all(order[i] < order[before] for i in a.all_input_nodes) for a in late)
    if movable:
        for a in late:
            before.prepend(a)
    return movable


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
