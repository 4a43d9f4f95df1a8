"""A fused projection cut into parts becomes one projection per part, each on its rows of the one weight.

Several transformers models compute queries, keys and values (or an MLP's
gate and up) with one weight and cut the result:

    q, k, v = (x @ W.T).view(b, s, heads + 2, d).split([heads, 1, 1], dim=-2)   # Falcon, one K/V head
    q, k, v = qkv_proj(x)[..., :q_end], [..., q_end:k_end], [..., k_end:]       # Phi-3
    gate, up = gate_up_proj(x).chunk(2, dim=-1)                                  # Phi-3's MLP

No even split of the fused features gives each device matching pieces of
every part (Falcon's single key head cannot be split at all), so the
planner could only run such a projection, and what follows, whole. Written
per part, on slices of the one weight,

    q = (x @ W[:heads * d].T).view(b, s, heads, d), and so on,

it is the same products summed in the same order (exact), and each part
splits like any projection: the queries by heads while one key and value
head stay whole, gate and up by the same columns. The weight stays one
parameter, whole on every device; each part's gradient arrives in its rows.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autotp.capture.emit import emit

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_TRANSPOSES = (aten.numpy_T.default, aten.t.default)
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default)


def unfuse_projections(gm: fx.GraphModule) -> None:
    """Rewrite each projection ``linear(x, W[, b])`` or ``matmul(x, W.T)`` (``+ b``) of a parameter ``W`` whose
    output features are only ever cut into parts (`_parts`) as one projection per part."""
    params = dict(gm.named_parameters())
    for node in list(gm.graph.nodes):
        found = _projection(node, params)
        parts = _parts(node) if found is not None else None
        if parts:
            _rewrite(gm, node, found, parts)


def _parameter(node, params) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and node.target in params


def _projection(node: fx.Node, params):
    """``(x, weight, bias, transpose op or None)`` when ``node`` is a projection by a 2-D weight parameter (with
    its bias, added inside or after), else None."""
    bias = None
    if node.target == aten.add.Tensor and _parameter(node.args[1], params) and params[node.args[1].target].dim() == 1:
        bias, node = node.args[1], node.args[0]
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
    if node.target == aten.linear.default and _parameter(node.args[1], params):
        x, weight, transpose = node.args[0], node.args[1], None
        if len(node.args) > 2 and node.args[2] is not None:
            if bias is not None or not _parameter(node.args[2], params):
                return None
            bias = node.args[2]
    elif (node.target == aten.matmul.default and isinstance(node.args[1], fx.Node)
          and node.args[1].target in _TRANSPOSES and _parameter(node.args[1].args[0], params)
          and len(node.args[1].users) == 1):
        x, weight, transpose = node.args[0], node.args[1].args[0], node.args[1].target
    else:
        return None
    return (x, weight, bias, transpose) if params[weight.target].dim() == 2 else None


def _parts(out: fx.Node) -> list[tuple[fx.Node, int, int, list | None]] | None:
    """``(node, first feature, end feature, shape)`` per part when every use of ``out`` cuts its features: the
    node to replace, and the shape to view the part's projection as (None: as it is). Cuts are slices of the last
    dim, a split or chunk of it, or a view of the features as ``(heads, head dim)`` split by heads."""
    shape = out.meta["val"].shape
    last = len(shape) - 1
    users = list(out.users)
    if users and all(u.target == aten.slice.Tensor and _dim(u, 1) == last and _step(u) == 1 for u in users):
        return [(u, _clamp(u.args[2] if len(u.args) > 2 else 0, shape[-1]),
                 _clamp(u.args[3] if len(u.args) > 3 else shape[-1], shape[-1]), None) for u in users]
    if len(users) != 1:
        return None
    cut, unit, view = users[0], 1, None
    if cut.target in _VIEWS and len(cut.users) == 1:
        view, cut = cut.meta["val"].shape, next(iter(cut.users))
        if tuple(view[:-2]) != tuple(shape[:-1]) or view[-2] * view[-1] != shape[-1]:
            return None
        unit, last = view[-1], len(view) - 2
    if cut.target not in _SPLITS or _dim(cut, 2) % (last + 1) != last:
        return None
    if any(u.target is not operator.getitem for u in cut.users):
        return None
    parts, start = [], 0
    for piece in cut.meta["val"]:
        size = piece.shape[last]
        parts.append((start, start + size))
        start += size
    return [(g, parts[g.args[1]][0] * unit, parts[g.args[1]][1] * unit,
             None if view is None else list(view[:-2]) + [parts[g.args[1]][1] - parts[g.args[1]][0], unit])
            for g in cut.users]


def _dim(node: fx.Node, index: int) -> int:
    dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
    return dim % len(node.args[0].meta["val"].shape)


def _step(node: fx.Node) -> int:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)


def _clamp(index, size: int) -> int:
    index = size + index if index < 0 else index
    return max(0, min(int(index), size))


def _rewrite(gm, out, projection, parts) -> None:
    x, weight, bias, transpose = projection
    replaced = []
    with gm.graph.inserting_before(out.next):
        for node, first, end, shape in parts:
            w = emit(gm, aten.slice.Tensor, weight, 0, first, end, like=out)
            b = emit(gm, aten.slice.Tensor, bias, 0, first, end, like=out) if bias is not None else None
            if transpose is not None:
                y = emit(gm, aten.matmul.default, x, emit(gm, transpose, w, like=out), like=out)
                y = emit(gm, aten.add.Tensor, y, b, like=out) if b is not None else y
            else:
                y = emit(gm, aten.linear.default, x, w, *((b,) if b is not None else ()), like=out)
            replaced.append((node, emit(gm, aten.view.default, y, shape, like=out) if shape is not None else y))
    dead = []
    for node, part in replaced:
        dead += [n for n in node.all_input_nodes if n not in dead]
        node.replace_all_uses_with(part)
        gm.graph.erase_node(node)
    while dead:  # the fused chain, back to the weight, as nothing reads it any more
        node = dead.pop(0)
        if node.op == "call_function" and not node.users:
            dead += [n for n in node.all_input_nodes if n not in dead]
            gm.graph.erase_node(node)
