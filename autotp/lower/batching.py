"""Batch independent collectives into one, start them early and wait for them late (a lowering pass).

After `lower` has inserted one `Collective` per redistribution step, this pass
groups collectives of the same kind on the same mesh axis that do not depend
on each other and share a dtype (the rule is `autotp.lower.batch_rule.batch_groups`;
concatenating an int64 tensor with floats would change it) and replaces each group by two graph nodes:

    h = all_gather_axis0_x3_start(q_in, k_in, v_in)   # flatten, concatenate, one async collective
    ...                                             # compute that does not need the result
    out = all_gather_axis0_x3_wait(h)                  # wait, split back, reshape

The backward pass mirrors it: the wait node's backward starts the dual
collective on the flattened gradients, and the start node's backward waits
for it, so a gradient reduction runs while autograd computes the layers in
between (for the gradients of replicated parameters this is DDP's bucketed,
overlapped all-reduce). The math is unchanged: each tensor gets exactly the
elements the single collective would give it.

Without overlap the start and wait nodes sit next to each other; without
batching every group has one member.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch import nn

from autotp.lower.batch_rule import DEFAULT_CAP_BYTES, Item, batch_groups
from autotp.lower.collectives import Collective, count
from autotp.lower.regather import regathering_nodes


# kind of a Collective -> (forward primitive, backward primitive), DESIGN.md's table of duals
DUALS = {
    "all_reduce": ("all_reduce", "identity"),
    "grad_all_reduce": ("identity", "all_reduce"),
    "all_gather": ("gather", "chunk"),
    "all_gather_rs": ("gather", "reduce_scatter"),
    "reduce_scatter": ("reduce_scatter", "gather"),
    "slice": ("chunk", "gather"),
}


@dataclass
class Pending:
    """A collective in flight: the buffer a functional collective returned, not yet waited for (None when
    nothing was sent), and how to unpack the buffer once it has landed."""

    buffer: torch.Tensor | None
    unpack: object  # (landed buffer) -> list[Tensor]

    def finish(self) -> list[torch.Tensor]:
        return self.unpack(funcol.wait_tensor(self.buffer) if self.buffer is not None else None)


def _flat(xs) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _split(buf: torch.Tensor, shapes) -> list[torch.Tensor]:
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return [piece.view(s) for piece, s in zip(buf.split(sizes), shapes)]


def _start_all_reduce(xs, dims, comm) -> Pending:
    buf = _flat(xs)
    count(comm, "all_reduce", buf.numel() * buf.element_size())
    shapes = [x.shape for x in xs]
    return Pending(funcol.all_reduce(buf, "sum", comm.group), lambda out: _split(out, shapes))


def _start_gather(xs, dims, comm) -> Pending:
    """All-gather each tensor along its own dim, in one collective of the concatenated flat pieces."""
    n, local = comm.size, _flat(xs)
    count(comm, "all_gather", n * local.numel() * local.element_size())
    shapes = [x.shape for x in xs]

    def unpack(out):
        rows, pieces, start = out.view(n, -1), [], 0
        for shape, dim in zip(shapes, dims):
            size = int(torch.Size(shape).numel())
            part = rows[:, start:start + size].reshape(n, *shape)  # (n, *local shape): rank-major
            merged = list(shape)
            merged[dim] *= n
            pieces.append(part.movedim(0, dim).reshape(merged))  # rank r's piece at position r along dim
            start += size
        return pieces

    return Pending(funcol.all_gather_single(local, 0, comm.group), unpack)


def _start_reduce_scatter(xs, dims, comm) -> Pending:
    """Sum over the axis and keep this rank's chunk of each tensor along its dim, in one collective."""
    n = comm.size
    fronts = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    packed = torch.cat([f.reshape(n, -1) for f in fronts], dim=1).reshape(-1)  # rank-major chunks
    count(comm, "reduce_scatter", packed.numel() * packed.element_size())

    def unpack(out):
        local = [(f.shape[0] // n,) + tuple(f.shape[1:]) for f in fronts]
        return [piece.movedim(0, d) for piece, d in zip(_split(out, local), dims)]

    return Pending(funcol.reduce_scatter_single(packed, "sum", 0, comm.group), unpack)


def _start_chunk(xs, dims, comm) -> Pending:
    pieces = [x.chunk(comm.size, dim=d)[comm.index].contiguous() for x, d in zip(xs, dims)]
    return Pending(None, lambda _: pieces)


def _start_identity(xs, dims, comm) -> Pending:
    return Pending(None, lambda _: [x.view_as(x) for x in xs])


_START = {"all_reduce": _start_all_reduce, "gather": _start_gather, "reduce_scatter": _start_reduce_scatter,
          "chunk": _start_chunk, "identity": _start_identity}


@dataclass
class _Token:
    """Carries one call's collective in flight from the start node to the wait node, and back in backward."""

    forward: Pending | None = None
    backward: Pending | None = None
    needs: tuple = ()  # which inputs want a gradient: only their gradients travel in backward


@dataclass(frozen=True)
class BatchSpec:
    kind: str
    comm: object
    dims: tuple = field(default=())

    def start(self, phase: int, xs, members=None) -> Pending:
        dims = self.dims if members is None else tuple(self.dims[i] for i in members)
        return _START[DUALS[self.kind][phase]](list(xs), dims, self.comm)


class _StartFn(torch.autograd.Function):
    """Forward: start the batch's collective. Backward: wait for the dual the wait node started."""

    @staticmethod
    def forward(ctx, spec, token, *xs):
        ctx.token = token
        token.needs = ctx.needs_input_grad[2:]
        token.forward = spec.start(0, xs)
        return xs[0].new_empty(0)  # only links this node to the wait node for autograd

    @staticmethod
    def backward(ctx, _link):
        token = ctx.token
        grads, token.backward = iter(token.backward.finish()), None
        return (None, None, *(next(grads) if need else None for need in token.needs))


class _WaitFn(torch.autograd.Function):
    """Forward: wait for the batch and split it back. Backward: start the dual on the flattened gradients."""

    @staticmethod
    def forward(ctx, spec, token, link):
        ctx.spec, ctx.token, ctx.link_meta = spec, token, (link.dtype, link.device)
        outs, token.forward = token.forward.finish(), None
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        members = [i for i, need in enumerate(ctx.token.needs) if need]
        ctx.token.backward = ctx.spec.start(1, [grads[i] for i in members], members)
        dtype, device = ctx.link_meta
        return None, None, torch.empty(0, dtype=dtype, device=device)


class BatchStart(nn.Module):
    """Starts one collective for every input tensor (flattened into one buffer); returns a handle."""

    def __init__(self, spec: BatchSpec):
        super().__init__()
        self.spec = spec

    def forward(self, *xs):
        token = _Token()
        return _StartFn.apply(self.spec, token, *xs), token

    def extra_repr(self) -> str:
        return f"{self.spec.kind} on {self.spec.comm.name} of {len(self.spec.dims)} tensors, dims {self.spec.dims}"


class BatchWait(nn.Module):
    """Waits for a `BatchStart`'s collective; returns the tensors in the order they were given."""

    def __init__(self, spec: BatchSpec):
        super().__init__()
        self.spec = spec

    def forward(self, handle):
        link, token = handle
        return _WaitFn.apply(self.spec, token, link)


def _dtype(node: fx.Node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _tensor_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def batch_collectives(gm: fx.GraphModule, batch: bool = True, overlap: bool = True,
                      cap_bytes: int = DEFAULT_CAP_BYTES) -> int:
    """Rewrite ``gm``'s `Collective` calls into start/wait pairs, merged where `batch_groups` allows.

    Returns the number of collectives left. With neither ``batch`` nor
    ``overlap`` the graph is left as it is.
    """
    regathering = set(regathering_nodes(gm))  # their outputs are tagged for backward to gather again: left alone
    nodes = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Collective)
             and n not in regathering]
    if not (batch or overlap) or not nodes:
        return len(nodes) + len(regathering)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    index = {n: i for i, n in enumerate(nodes)}
    items = []
    for n in nodes:
        module, source = gm.get_submodule(n.target), n.args[0]
        items.append(Item(key=(module.kind, module.comm.name, _dtype(source)), nbytes=_tensor_bytes(source),
                          ready=pos[source], needed=min(pos[u] for u in n.users) if n.users else len(pos),
                          depends_on=index.get(source)))
    groups = batch_groups(items, cap_bytes) if batch else [[i] for i in range(len(nodes))]
    for g, members in enumerate(groups):
        _replace(gm, [nodes[i] for i in members], g, overlap)
    for name in {n.target for n in nodes} - {n.target for n in regathering}:  # modules no node calls any more
        gm.delete_submodule(name)
    gm.graph.lint()
    gm.recompile()
    return len(groups) + len(regathering)


def _replace(gm: fx.GraphModule, members: list[fx.Node], g: int, overlap: bool) -> None:
    modules = [gm.get_submodule(n.target) for n in members]
    first = modules[0]
    spec = BatchSpec(first.kind, first.comm, tuple(m.dim if m.dim is not None else 0 for m in modules))
    name = f"{first.kind}_{first.comm.name}_b{g}"
    gm.add_submodule(f"{name}_start", BatchStart(spec))
    gm.add_submodule(f"{name}_wait", BatchWait(spec))
    sources = [n.args[0] for n in members]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    users = [u for n in members for u in n.users]
    first_user = min(users, key=order.get) if users else None
    last_source = max(sources, key=order.get)
    if last_source.op == "placeholder":  # start after every input of the graph, not among them
        last_source = max((n for n in gm.graph.nodes if n.op == "placeholder"), key=order.get)
    if overlap:
        with gm.graph.inserting_after(last_source):
            start = gm.graph.call_module(f"{name}_start", tuple(sources))
    else:
        with gm.graph.inserting_before(first_user or members[0]):
            start = gm.graph.call_module(f"{name}_start", tuple(sources))
    with gm.graph.inserting_before(first_user or members[-1].next):
        wait = gm.graph.call_module(f"{name}_wait", (start,))
        for i, n in enumerate(members):
            out = gm.graph.call_function(operator.getitem, (wait, i))
            out.meta["val"] = n.meta.get("val")
            n.replace_all_uses_with(out)
    for n in members:
        gm.graph.erase_node(n)
