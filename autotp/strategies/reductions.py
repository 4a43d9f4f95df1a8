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
