"""Turn one layout into another: the ordered collectives on each mesh axis, forward and backward.

Used by both the cost model and the lowering, so what is costed is exactly what
runs. Per axis the forward transitions and their autograd duals are:

    P -> R     all-reduce       backward: nothing
    P -> S(d)  reduce-scatter   backward: all-gather
    S(d) -> R  all-gather       backward: local slice if the gradient arriving is R,
                                          reduce-scatter if it is partial
    R -> S(d)  local slice      backward: all-gather
    S(d) -> S(e)  all-gather then slice (costed as such)
    R consumed by split work    backward: all-reduce of the partial gradient (Megatron's f)

The gradient arriving is partial on an axis exactly when the consumer's strategy
takes the input R there while splitting its work (`Strategy.grad_allreduce_axes`).
When an all-gather on that axis comes right before, its backward becomes a
reduce-scatter (sequence parallelism's pairing); otherwise an f step is added.

Axes are unsharded innermost first and sharded outermost first, so a dim split
on several axes keeps DTensor's nesting order.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.placement import Partial, Replicate, Shard, local_bytes

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SLICE = "all_reduce", "all_gather", "reduce_scatter", "slice"
GRAD_ALL_REDUCE = "grad_all_reduce"
ALL_GATHER_RS = "all_gather_rs"  # all-gather whose incoming gradient is partial: backward reduce-scatter
_FORWARD = {ALL_REDUCE: ALL_REDUCE, ALL_GATHER: ALL_GATHER, ALL_GATHER_RS: ALL_GATHER,
            REDUCE_SCATTER: REDUCE_SCATTER, SLICE: None, GRAD_ALL_REDUCE: None}
_BACKWARD = {ALL_REDUCE: None, ALL_GATHER: None, ALL_GATHER_RS: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER,
             SLICE: ALL_GATHER, GRAD_ALL_REDUCE: ALL_REDUCE}


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one mesh axis.

    ``message_bytes`` follows nccl-tests: the all-reduce buffer, the gathered
    output of an all-gather, the full input of a reduce-scatter.
    """

    kind: str
    axis: int
    dim: int | None
    message_bytes: int

    @property
    def forward_kind(self) -> str | None:
        """The collective run in forward, or None (a local slice, or an f step)."""
        return _FORWARD[self.kind]

    @property
    def backward_kind(self) -> str | None:
        """The collective run in backward, or None."""
        return _BACKWARD[self.kind]


class Unsupported(Exception):
    """This transition is not offered (e.g. R -> P); the planner never chooses it."""


def _dims_split(layout, dim):
    return [a for a, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]


def _axes_to_clear(src, dst) -> set[int]:
    """Axes whose placement must be undone first, including inner axes nested under them."""
    clear = {a for a in range(len(src)) if src[a] != dst[a] and not isinstance(src[a], Replicate)}
    changed = True
    while changed:
        changed = False
        for a in range(len(src)):
            touched = {p.dim for p in (src[a], dst[a]) if isinstance(p, Shard)}
            if src[a] == dst[a] and a not in clear:
                continue
            for b in range(a + 1, len(src)):
                if b not in clear and isinstance(src[b], Shard) and src[b].dim in touched:
                    clear.add(b)
                    changed = True
    return clear


def plan_steps(src, dst, meta, mesh_shape, grad_axes=()) -> list[Step]:
    """The steps that turn layout ``src`` into ``dst`` for a tensor of ``meta``.

    ``grad_axes`` are the axes on which the consumer hands back a partial
    gradient; each is served by the last all-gather on that axis or by an f step.
    """
    steps = _layout_steps(src, dst, meta, mesh_shape)
    for axis in grad_axes:
        last = [i for i, s in enumerate(steps) if s.axis == axis]
        if last and steps[last[-1]].kind == ALL_GATHER:
            s = steps[last[-1]]
            steps[last[-1]] = Step(ALL_GATHER_RS, s.axis, s.dim, s.message_bytes)
        else:
            steps.append(Step(GRAD_ALL_REDUCE, axis, None, local_bytes(meta, dst, mesh_shape)))
    return steps


def _layout_steps(src, dst, meta, mesh_shape) -> list[Step]:
    if any(isinstance(d, Partial) and not isinstance(s, Partial) for s, d in zip(src, dst)):
        raise Unsupported(f"cannot produce a partial sum from {src}")
    cur, steps = list(src), []
    for a in sorted(_axes_to_clear(src, dst), reverse=True):
        n = mesh_shape[a]
        piece_bytes = local_bytes(meta, cur, mesh_shape)
        if isinstance(cur[a], Shard):
            steps.append(Step(ALL_GATHER, a, cur[a].dim, piece_bytes * n))
        elif isinstance(dst[a], Shard) and not any(
                b != a and dst[a].dim in (getattr(cur[b], "dim", None), getattr(dst[b], "dim", None))
                for b in range(len(cur))):
            steps.append(Step(REDUCE_SCATTER, a, dst[a].dim, piece_bytes))
            cur[a] = dst[a]
            continue
        else:
            steps.append(Step(ALL_REDUCE, a, None, piece_bytes))
        cur[a] = Replicate()
    for a in range(len(cur)):
        if cur[a] != dst[a]:
            steps.append(Step(SLICE, a, dst[a].dim, local_bytes(meta, cur, mesh_shape)))
            cur[a] = dst[a]
    return steps
