"""An `OpGraph` at another batch size, read off two captures of the same model at two other sizes.

`autotp.plan` tries several numbers of micro-batches, and each count's
problem starts from the model captured at its micro-batch size: 1.3 to 1.9 s
of `torch.export` and graph building for Llama-2-70B on 4x8, six counts at
batch 64. The graphs of one model at different batch sizes differ only in
the numbers that are the batch, or a multiple of it: dims of shapes and the
integers among an op's arguments (a ``view``'s sizes). Two captures, at
batches ``a`` and ``b``, say which numbers those are (a number that is
``n_a`` at ``a`` and ``n_a * b / a`` at ``b``), and a third batch ``c`` then
gives ``n_a * c / a`` for each and keeps every other number.

This is exact for every graph whose shapes are proportional to the batch,
which is what the two captures check: the graphs must match op for op
(names, targets, inputs, edges, every argument that is not such a number),
and each number must be equal at both sizes or scale with the batch.
Anything else (an op only one size traces, a dim of ``batch ** 2`` or
``batch + 1``, a float that depends on the batch, a size that does not
divide) raises `NotProportional`, and the caller captures that size for
real. A micro-batch of one sample is always captured (`derivable`): tracing
specialises size 1 (a ``squeeze`` that drops it, a branch on
``batch == 1``), and two larger sizes cannot show that. FLOPs and bytes are
computed again from the new shapes, as `autotp.graph.build_opgraph` does,
and an op whose own saved bytes differ between the two (a loss keeps its
log-probabilities and a scalar: not quite proportional) is probed again at
the new size (`autotp.graph.saved`).
"""

from __future__ import annotations

from dataclasses import fields, replace

from autotp.graph.flops import op_bytes, op_flops
from autotp.graph.opgraph import KIND_OP, OpGraph, OpNode, TensorMeta
from autotp.graph.saved import saved_by_op


class NotProportional(ValueError):
    """The two captures differ in more than numbers proportional to the batch: capture the size for real."""


def derivable(batch: int) -> bool:
    """Whether a graph at this batch size may be read off two others (`resized`): not at one sample."""
    return batch > 1


def resized(first: OpGraph, first_batch: int, second: OpGraph, second_batch: int, batch: int) -> OpGraph:
    """``first`` (captured at ``first_batch``) at ``batch``, with ``second`` (at ``second_batch``) saying which
    numbers are proportional to the batch; raises `NotProportional` where the two say otherwise."""
    if first_batch == second_batch or not (derivable(first_batch) and derivable(second_batch) and derivable(batch)):
        raise NotProportional(f"batches {first_batch}, {second_batch} and {batch}: need two sizes above one")
    if first.order != second.order or first.outputs != second.outputs:
        raise NotProportional("the two captures have different ops")
    if set(first.graph.edges(data="inputs")) != set(second.graph.edges(data="inputs")):
        raise NotProportional("the two captures connect their ops differently")
    scale = _Scale(first_batch, second_batch, batch)
    graph = first.graph.copy()
    needs_grad = {name: first.node(name).requires_grad for name in first.order}
    for name in first.order:
        graph.nodes[name]["op"] = _op(first.node(name), second.node(name), scale, needs_grad)
    return OpGraph(graph, list(first.order), list(first.outputs))


class _Scale:
    """``n`` at batch ``a`` and ``m`` at batch ``b``: ``n`` again when equal, else ``n * c / a`` when ``m`` is
    ``n * b / a`` and that divides; anything else is not proportional."""

    def __init__(self, a: int, b: int, c: int):
        self.a, self.b, self.c = a, b, c

    def number(self, n: int, m: int) -> int:
        if n == m:
            return n
        if n * self.b != m * self.a or (n * self.c) % self.a:
            raise NotProportional(f"{n} at batch {self.a} and {m} at batch {self.b}")
        return n * self.c // self.a


# computed again at the new size: FLOPs and bytes from the shapes, and what backward keeps where it differs
_FOUND_AGAIN = frozenset({"flops", "bytes", "saved_extra"})


def _op(a: OpNode, b: OpNode, scale: _Scale, needs_grad: dict[str, bool]) -> OpNode:
    values = {f.name: _value(getattr(a, f.name), getattr(b, f.name), scale)
              for f in fields(OpNode) if f.name not in _FOUND_AGAIN}
    op = replace(a, **values)
    if op.kind != KIND_OP:
        return op
    op = replace(op, flops=op_flops(op.target, op.in_metas, op.out), bytes=op_bytes(op.target, op.in_metas, op.out))
    return op if a.saved_extra == b.saved_extra else _saved_again(op, needs_grad)


def _saved_again(op: OpNode, needs_grad: dict[str, bool]) -> OpNode:
    """``op`` with what its backward keeps found again at the new size: the bytes of its own (a loss's
    log-probabilities and a scalar or two) are a fraction of its largest tensor's that differs with the batch."""
    saved = saved_by_op(op.target, op.args, op.kwargs, op.inputs, needs_grad)
    if saved is None or saved.inputs != op.saves_inputs or saved.output > op.keeps_output:
        raise NotProportional(f"what {op.name} keeps for backward at the new batch size")
    return replace(op, saved_extra=saved.extra)


def _value(a, b, scale: _Scale):
    """``a`` at the new batch, walking tuples, lists, dicts and `TensorMeta` shapes alike in both captures;
    anything else must be the same in both."""
    if type(a) is not type(b):
        raise NotProportional(f"{a!r} and {b!r}")
    if type(a) is int:  # not bool: a flag is the same at every size
        return scale.number(a, b)
    if isinstance(a, TensorMeta):
        if a.dtype != b.dtype or len(a.shape) != len(b.shape):
            raise NotProportional(f"{a} and {b}")
        return TensorMeta(tuple(scale.number(n, m) for n, m in zip(a.shape, b.shape)), a.dtype)
    if isinstance(a, (tuple, list)) and not hasattr(a, "_fields"):  # fx's immutable lists too; a named tuple whole
        if len(a) != len(b):
            raise NotProportional(f"{a!r} and {b!r}")
        return type(a)(_value(x, y, scale) for x, y in zip(a, b))
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise NotProportional(f"{a!r} and {b!r}")
        return {key: _value(a[key], b[key], scale) for key in a}
    if a != b:  # a float, a flag, a dtype, a target, a name: the same at every size
        raise NotProportional(f"{a!r} and {b!r}")
    return a
