"""sum and mean: kept dims split through; summing over a split dim leaves a partial sum.

``mean`` over a split dim is not offered: each device would divide by its local
count. Both ops are linear, so a partial input stays partial.
"""

from __future__ import annotations

from autotp.strategies.base import AxisOption, P, Shard


def _reduced_dims(op) -> tuple[int, ...]:
    nd = len(op.in_metas[0].shape)
    dims = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    if dims is None or dims == []:
        return tuple(range(nd))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % nd for d in dims))


def _keepdim(op) -> bool:
    return bool(op.args[2]) if len(op.args) > 2 else bool(op.kwargs.get("keepdim", False))


def _out_dim(d: int, reduced, keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def _reduction_options(op, partial_over_reduced: bool):
    x = op.in_metas[0]
    reduced, keep = _reduced_dims(op), _keepdim(op)
    options = [AxisOption(P, (P,))]
    for d, size in enumerate(x.shape):
        if size == 1:
            continue
        if d not in reduced:
            options.append(AxisOption(Shard(_out_dim(d, reduced, keep)), (Shard(d),)))
        elif partial_over_reduced:
            options.append(AxisOption(P, (Shard(d),)))
    return options


def sum_rule(op):
    return _reduction_options(op, partial_over_reduced=True)


def mean_rule(op):
    return _reduction_options(op, partial_over_reduced=False)


def schema_args(op) -> dict:
    """``op``'s arguments by their schema names, defaults filled in (positional and keyword alike)."""
    bound = {}
    for i, arg in enumerate(op.target._schema.arguments):
        if not arg.kwarg_only and i < len(op.args):
            bound[arg.name] = op.args[i]
        elif arg.name in op.kwargs:
            bound[arg.name] = op.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _dims_along(op, name: str):
    """The dims an op reduces along, from its argument ``name`` (None or [] mean every dim)."""
    nd = len(op.in_metas[0].shape)
    dims = schema_args(op).get(name)
    if dims is None or dims == []:
        return tuple(range(nd))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % max(nd, 1) for d in dims))


def _split_other_dims(op, along, keepdim: bool):
    """Every output (values and indices alike) split on a dim the op does not work along."""
    x = op.in_metas[0]
    return [AxisOption(Shard(_out_dim(d, along, keepdim)), (Shard(d),))
            for d, size in enumerate(x.shape) if d not in along and size > 1]


def dim_reduction_rule(op):
    """``max.dim``, ``min.dim``, ``argmax``, ``argmin``, ``amax``, ``amin``, ``logsumexp``,
    ``var``, ``std``, ``var_mean``, ``std_mean``: the kept dims split through.

    None of these is a sum, so reducing over a split dim is never offered: the
    maximum of a slice or the variance of a slice is not a piece of the answer.
    """
    along = _dims_along(op, "dim")
    return _split_other_dims(op, along, bool(schema_args(op).get("keepdim", False)))


def along_dim_rule(op):
    """``topk``, ``sort``, ``cumsum``, ``cumprod``: the output keeps every dim; split all but ``dim``."""
    nd = len(op.in_metas[0].shape)
    dim = schema_args(op).get("dim", -1) % max(nd, 1)
    return _split_other_dims(op, (dim,), keepdim=True)
