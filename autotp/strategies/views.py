"""view, reshape, transpose, permute, unsqueeze, expand, slice, pad, split, chunk, cat, getitem.

The hard one is a view that splits or merges a sharded dim, as the attention
head split ``[b, s, h*d] -> [b, s, h, d]`` does. `view_dim_map` groups input and
output dims into runs of equal product; a split on a run's first non-trivial
input dim maps to the first non-trivial output dim of the run. The split is
valid when that output dim divides evenly, which `expand` checks, so
``h*d -> (h, d)`` split 4 ways is offered only when 4 divides ``h``.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, R, Shard


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def view_dim_map(in_shape, out_shape) -> dict[int, int]:
    """Input dim -> output dim for dims whose split survives the view.

    >>> view_dim_map((2, 4, 16), (2, 4, 2, 8))
    {0: 0, 1: 1, 2: 2}
    >>> view_dim_map((2, 4, 2, 8), (8, 16))
    {0: 0, 2: 1}
    """
    mapping, i, j = {}, 0, 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        first_in = next((d for d in gi if in_shape[d] > 1), None)
        first_out = next((d for d in gj if out_shape[d] > 1), None)
        if first_in is not None and first_out is not None:
            mapping[first_in] = first_out
        i, j = i + 1, j + 1
    return mapping


def _passthrough_partial(op):
    return [AxisOption(P, (P,))]


def _mapped(op, mapping: dict[int, int]) -> list[AxisOption]:
    return [AxisOption(Shard(o), (Shard(i),)) for i, o in mapping.items()] + _passthrough_partial(op)


def view_rule(op):
    return _mapped(op, view_dim_map(op.in_metas[0].shape, op.out[0].shape))


def transpose_rule(op):
    nd = len(op.in_metas[0].shape)
    a, b = _norm(op.args[1], nd), _norm(op.args[2], nd)
    perm = list(range(nd))
    perm[a], perm[b] = b, a
    return _mapped(op, {src: dst for dst, src in enumerate(perm)})


def permute_rule(op):
    nd = len(op.in_metas[0].shape)
    perm = [_norm(d, nd) for d in op.args[1]]
    return _mapped(op, {src: dst for dst, src in enumerate(perm)})


def t_rule(op):
    nd = len(op.in_metas[0].shape)
    return _mapped(op, {0: 1, 1: 0} if nd == 2 else {0: 0})


def numpy_t_rule(op):
    """``x.T``: every dim reversed (``t`` for a matrix)."""
    nd = len(op.in_metas[0].shape)
    return _mapped(op, {d: nd - 1 - d for d in range(nd)})


def unsqueeze_rule(op):
    nd = len(op.in_metas[0].shape)
    at = _norm(op.args[1], nd + 1)
    return _mapped(op, {d: d + (d >= at) for d in range(nd)})


def expand_rule(op):
    """Matching dims split together; a broadcast dim may be split on the output alone."""
    in_shape, out_shape = op.in_metas[0].shape, op.out[0].shape
    offset = len(out_shape) - len(in_shape)
    options = []
    for dim, size in enumerate(out_shape):
        src = dim - offset
        if size == 1:
            continue
        inp = Shard(src) if src >= 0 and in_shape[src] == size else R
        options.append(AxisOption(Shard(dim), (inp,)))
    return options + _passthrough_partial(op)


def _all_but(op, dim: int):
    nd = len(op.in_metas[0].shape)
    dim = _norm(dim, nd)
    return [AxisOption(Shard(d), (Shard(d),) * len(op.inputs)) for d in range(nd) if d != dim]


def slice_rule(op):
    dim = op.args[1] if len(op.args) > 1 else 0
    return _all_but(op, dim) + _passthrough_partial(op)


def pad_rule(op):
    """Constant pad: any dim it does not pad may be split (``pad`` lists (before, after) from the last dim).

    ``aten.pad(x, pad, mode, value)`` names its mode; ``constant_pad_nd(x, pad, value)`` is always constant.
    """
    nd = len(op.in_metas[0].shape)
    pads = list(op.args[1]) if len(op.args) > 1 else list(op.kwargs.get("pad", []))
    named_mode = "constant_pad_nd" not in str(op.target)
    mode = (op.args[2] if len(op.args) > 2 else op.kwargs.get("mode", "constant")) if named_mode else "constant"
    if mode != "constant":
        return []
    padded = {nd - 1 - k // 2 for k, amount in enumerate(pads) if amount}
    return [AxisOption(Shard(d), (Shard(d),)) for d in range(nd) if d not in padded]


def split_rule(op):
    """split/chunk: every piece shares the input's split, on any dim but the split dim."""
    dim = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)
    return _all_but(op, dim) + _passthrough_partial(op)


def cat_rule(op):
    dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    n = len(op.inputs)
    return _all_but(op, dim) + [AxisOption(P, (P,) * n)]


def getitem_rule(op):
    """A piece of a multi-output op carries the layout of that op's output."""
    nd = len(op.out[0].shape)
    return [AxisOption(Shard(d), (Shard(d),)) for d in range(nd)] + _passthrough_partial(op)



def flatten_rule(op):
    """``flatten(x, start, end)`` is a view that merges dims start..end."""
    return view_rule(op)


def select_rule(op):
    """``select(x, dim, i)`` drops ``dim``: every other dim keeps its split."""
    nd = len(op.in_metas[0].shape)
    dim = _norm(op.args[1], nd)
    mapping = {d: d - (d > dim) for d in range(nd) if d != dim}
    return _mapped(op, mapping)
