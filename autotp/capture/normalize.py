"""Graph rewrites that make the captured ATen graph easier to shard, without changing its math.

``linear(x, w, b)`` becomes ``add(linear(x, w), b)`` and ``addmm(b, x, w)``
becomes ``add(mm(x, w), b)``: a bias cannot be added to a partial sum on every
device, so splitting it off lets the planner all-reduce the row-parallel
product first and add the bias once, as Megatron-LM does.

``contiguous(x)`` is dropped: export records it only when the traced strides
need it, which depends on the sizes (CPU attention returns a transposed
layout at some sizes), so keeping it would make the same model's graph differ
between sizes; the lowering turns every ``view`` into ``reshape`` instead.

``_assert_tensor_metadata`` is dropped: export checks with it that a
``.to()`` finds the dtype and device it traced, which a captured graph holds
by construction; every rank program would otherwise run it each call (26 of
a small Llama decode step's 431 ops).

``mean(x, dims)`` becomes ``sum(x, dims) / count``: a sum over a split dim is a
partial sum, so an RMSNorm over a hidden dim split across devices all-reduces
one number per row instead of gathering the whole activation.

``batch_norm(x, ..., training=True)`` becomes its formula (`decompose_batch_norm`):
per-channel sums over the batch and spatial dims, so a batch split leaves
partial sums the planner all-reduces (synchronised batch norm, exact), and
the running statistics are written back with ``copy_`` into the buffers.

In-place ops on activations (``x.add_(y)``, ``relu_``, ``x += y``) become their
out-of-place form, and later readers of ``x`` read the result
(`functionalize_inplace`): a sharded program keeps several copies of one
tensor (a slice here, a gathered copy there), so an update in place would
reach only one of them. Updates of graph inputs and buffers stay in place and
run replicated, so every rank's buffer sees the same update.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autotp.capture.emit import emit
from autotp.capture.fused import unfuse_projections
from autotp.capture.lazycode import recompile_when_needed
from autotp.errors import CaptureError

aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> None:
    """Apply every normalization pass in place; the module's code is written when it is first run or read
    (`autotp.capture.lazycode`)."""
    decompose_batch_norm(gm)
    functionalize_inplace(gm)
    unfuse_projections(gm)
    split_linear_bias(gm)
    split_addmm(gm)
    mean_as_sum(gm)
    drop_contiguous(gm)
    drop_metadata_asserts(gm)
    gm.graph.lint()
    recompile_when_needed(gm)


def split_linear_bias(gm: fx.GraphModule) -> None:
    """``linear(x, w, b)`` -> ``add(linear(x, w), b)``, keeping node names and shapes."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.linear.default:
            continue
        if len(node.args) < 3 or node.args[2] is None:
            continue
        x, w, b = node.args[:3]
        with graph.inserting_after(node):
            add = graph.call_function(aten.add.Tensor, (node, b))
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        node.args = (x, w)
        add.meta = dict(node.meta)


def split_addmm(gm: fx.GraphModule) -> None:
    """``addmm(b, x, w)`` (GPT-2's Conv1D) -> ``add(mm(x, w), b)``, for the same reason as linear's bias."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.addmm.default or node.kwargs:
            continue
        b, x, w = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (x, w))
            add = graph.call_function(aten.add.Tensor, (mm, b))
        mm.meta, add.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)


def mean_as_sum(gm: fx.GraphModule) -> None:
    """``mean.dim(x, dims, keepdim)`` -> ``div(sum.dim_IntList(x, dims, keepdim), count)``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.mean.dim or node.kwargs.get("dtype") is not None:
            continue
        x = node.args[0]
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        shape = x.meta["val"].shape
        reduced = range(len(shape)) if not dims else [d % len(shape) for d in dims]
        count = 1
        for d in reduced:
            count *= int(shape[d])
        with graph.inserting_before(node):
            total = graph.call_function(aten.sum.dim_IntList, (x, list(dims or []), keepdim))
            mean = graph.call_function(aten.div.Tensor, (total, count))
        total.meta, mean.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(mean)
        graph.erase_node(node)


def drop_contiguous(gm: fx.GraphModule) -> None:
    """Remove ``aten.contiguous`` (the identity on values); views are lowered as reshapes."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.contiguous.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove export's ``aten._assert_tensor_metadata`` checks (of a ``.to()``'s input dtype and device)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)


def _redirect_later_uses(old: fx.Node, new: fx.Node, after: fx.Node, order: dict) -> None:
    """Readers of ``old`` placed after ``after`` read ``new`` instead (they ran after the update)."""
    for user in list(old.users):
        if user is not new and order.get(user, -1) > order[after]:
            user.replace_input_with(old, new)


def decompose_batch_norm(gm: fx.GraphModule) -> None:
    """Training-mode ``batch_norm`` -> per-channel sums, normalisation and running-statistic updates.

    Same formula as ATen's: biased variance to normalise, unbiased variance in
    ``running_var``, ``running = (1 - momentum) * running + momentum * batch``.
    The statistics written back are detached, as ATen updates them without
    autograd. ``momentum=None`` (a cumulative average) is left as it is.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.batch_norm.default or not node.args[5]:
            continue
        x, weight, bias, running_mean, running_var, _, momentum, eps = node.args[:8]
        if momentum is None:
            continue
        shape = tuple(x.meta["val"].shape)
        channels = shape[1]
        count = math.prod(shape) // channels
        dims = [0] + list(range(2, len(shape)))
        stat_shape = [1, channels] + [1] * (len(shape) - 2)
        with graph.inserting_before(node):
            mean = emit(gm, aten.div.Tensor, emit(gm, aten.sum.dim_IntList, x, dims, True), count)
            centered = emit(gm, aten.sub.Tensor, x, mean)
            var = emit(gm, aten.div.Tensor, emit(gm, aten.sum.dim_IntList,
                                                   emit(gm, aten.mul.Tensor, centered, centered), dims, True), count)
            out = emit(gm, aten.mul.Tensor, centered, emit(gm, aten.rsqrt.default, emit(gm, aten.add.Tensor, var, eps)))
            if weight is not None:
                out = emit(gm, aten.mul.Tensor, out, emit(gm, aten.view.default, weight, stat_shape))
            if bias is not None:
                out = emit(gm, aten.add.Tensor, out, emit(gm, aten.view.default, bias, stat_shape))
            for buffer, stat, scale in ((running_mean, mean, 1.0), (running_var, var, count / max(count - 1, 1))):
                if buffer is None:
                    continue
                batch = emit(gm, aten.detach.default, emit(gm, aten.view.default, stat, [channels]))
                update = emit(gm, aten.add.Tensor, emit(gm, aten.mul.Tensor, buffer, 1.0 - momentum),
                               emit(gm, aten.mul.Tensor, batch, momentum * scale))
                written = emit(gm, aten.copy_.default, buffer, update)
                order[written] = order[node]
                _redirect_later_uses(buffer, written, node, order)
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _is_inplace(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and not schema.name.endswith("_out") and not schema.overload_name.endswith("out")


def _returns_alias(node: fx.Node) -> bool:
    """Whether ``node``'s output may share memory with one of its inputs (views, reshape, contiguous)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _returns_alias(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _functional(target):
    """``aten.add_.Tensor`` -> ``aten.add.Tensor``; None when ATen has no out-of-place twin."""
    packet = getattr(aten, target._schema.name.removeprefix("aten::").removesuffix("_"), None)
    overload = target._overloadname
    return getattr(packet, overload, None) if packet is not None and overload in packet.overloads() else None


def _views_read_after(base: fx.Node, node: fx.Node, order: dict) -> bool:
    """True when a view of ``base`` taken before ``node`` is read after it (it would see the update)."""
    stack = [u for u in base.users if u is not node and order.get(u, -1) < order[node] and _returns_alias(u)]
    while stack:
        view = stack.pop()
        for user in view.users:
            if order.get(user, -1) > order[node]:
                return True
            if _returns_alias(user):
                stack.append(user)
    return False


_CONVERSIONS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other}


def _itself(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is, through ``.to()`` calls that convert nothing (ATen returns the input itself:
    transformers' static cache does ``length.to(device).add_(n)``)."""
    while (node.op == "call_function" and node.target in _CONVERSIONS and isinstance(node.args[0], fx.Node)
           and not node.kwargs.get("copy", False)):
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
                and (before.dtype, before.device, before.layout) == (after.dtype, after.device, after.layout)):
            break
        node = node.args[0]
    return node


def functionalize_inplace(gm: fx.GraphModule) -> None:
    """Rewrite in-place ops on activations out of place; keep (and order) updates of inputs and buffers.

    An in-place op on a view of another tensor, or on a tensor one of whose
    views is read after the update, changes more than its result: that is a
    `CaptureError` naming the op, rather than a program that may differ.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not _is_inplace(node) or not isinstance(node.args[0], fx.Node):
            continue
        target = _itself(node.args[0])
        if target is not node.args[0]:  # a `.to()` that converted nothing: the update writes the tensor itself
            _redirect_later_uses(node.args[0], node, node, order)
            node.replace_input_with(node.args[0], target)
        if target.op in ("placeholder", "get_attr"):
            _redirect_later_uses(target, node, node, order)
            continue
        functional = _functional(node.target)
        if functional is None or _returns_alias(target) or _views_read_after(target, node, order):
            what = "a view of another tensor" if _returns_alias(target) else "a tensor whose view is read later"
            if functional is None:
                what = "a tensor, and ATen has no out-of-place form of it"
            raise CaptureError(f"{node.target._schema.name.removeprefix('aten::')} updates {what} in place "
                               f"({target.name}): autotp cannot shard that exactly; write it out of place "
                               "(y = x + z instead of x += z)")
        dtype = node.meta["val"].dtype
        with graph.inserting_before(node):
            new = emit(gm, functional, *node.args, **node.kwargs)
            if new.meta["val"].dtype != dtype:  # in place keeps self's dtype; out of place may promote
                new = emit(gm, aten._to_copy.default, new, dtype=dtype)
        new.meta = {**node.meta, "val": new.meta["val"]}
        order[new] = order[node]
        _redirect_later_uses(target, new, node, order)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
