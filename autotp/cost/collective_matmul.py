"""Collective matmuls: a tensor-parallel all-gather or reduce-scatter cut into chunks that a matmul's rows hide.

Sequence parallelism puts an all-gather before a column-parallel matmul and a
reduce-scatter after a row-parallel one, both on the critical path. Yet the
rows of a matmul along the gathered (or scattered) dim are independent, so
with ``n`` devices on the axis the collective can run as a ring of ``n - 1``
steps while the matmul works on what has arrived (Wang et al., ASPLOS 2023;
Megatron-LM's tensor-parallel communication overlap, PyTorch's async TP):

* **gather, then multiply**: each device multiplies the rows it holds while
  the ring brings the next chunk, and then those;
* **multiply, then scatter**: each device computes its partial product for
  one chunk of rows, adds it to the running sum it received, and passes it on,
  computing the next chunk while the sum travels.

Backward runs the duals the same way: the gradient's all-gather (of a
scattered product) as a ring whose arriving chunks the matmul's backward
works on, and the gradient's reduce-scatter (of a gathered input) as a ring
that adds each chunk's input gradient on its way. Only one chunk's share of
the matmul runs alone, so each collective is exposed only by what
``(n - 1) / n`` of its matmul's pass cannot hide:

    hidden = min(forward collective, (n - 1) / n * matmul forward)
           + min(backward collective, (n - 1) / n * matmul backward)

`autotp.lower.collective_matmul` runs these forms wherever they are credited
(and fuses a few uses it is not credited for, never the reverse); one ring
serves every matmul that reads the gathered tensor (a layer's q, k and v),
credited use by use so that the credits add up to what the ring hides
(`fused_shares`).

A gathered input regathered (`autotp.solve.regather`: kept as its shard and
gathered again in backward) comes round again in the ring of the matmul's
backward, beside the input gradient's reduce-scatter: each chunk's share of
the weight's gradient is computed as it lands. Megatron-LM likewise overlaps
sequence parallelism's all-gather in backward with the input gradient's
matmul. Of the ``again`` seconds the ring hides what the backward pass has
left after its own collective:

    regather hidden = min(backward collective + again, (n - 1) / n * matmul backward)
                    - min(backward collective, (n - 1) / n * matmul backward)

It does so only where the matmuls are the gathered tensor's only readers
(any other would need it whole); otherwise the gather runs again, whole,
before the backward that reads it.

A use qualifies when its redistribution is one collective on one mesh axis of
more than one device, and:

* an all-gather feeding the first input of a matmul (``linear``, ``mm``,
  ``matmul`` by a 2-D weight) along a dim of its rows, the consumer's
  output not itself a partial sum (whose matmul hides the reduce-scatter after
  it instead: each matmul hides one collective);
* a reduce-scatter of a matmul's partial product along a dim of its rows,
  the product's only use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.cost.compute import backward_time_s, forward_time_s
from autotp.placement import Partial
from autotp.redistribute import ALL_GATHER, REDUCE_SCATTER, live_steps

aten = torch.ops.aten

MATMULS = (aten.linear.default, aten.mm.default, aten.matmul.default)


def splits_rows(target, x_ndim: int, other_ndim: int, dim: int) -> bool:
    """Whether rows of a matmul's first input taken along ``dim`` make the rows of its output along the same dim on
    their own (the second input a whole 2-D weight): then the matmul can run chunk by chunk of that dim.

        linear(x[b, s, k], w[n, k]), dim 1 -> True     mm(a[m, k], b[k, n]), dim 1 -> False (the contracted dim)
    """
    if target in MATMULS and other_ndim == 2:
        return 0 <= dim < x_ndim - 1
    return False


def lone_collective(steps, forward_s, backward_s, mesh_shape) -> tuple | None:
    """``(step, its forward seconds, its backward seconds)`` when a redistribution is one collective on one axis of
    more than one device, else None."""
    live = live_steps(steps, mesh_shape)
    if len(live) != 1 or len(live[0].span) > 1:
        return None
    k = steps.index(live[0])
    return live[0], forward_s[k], backward_s[k]


def _rows_of(op, dim: int) -> bool:
    metas = op.in_metas
    return (op.target in MATMULS and len(metas) >= 2
            and splits_rows(op.target, len(metas[0].shape), len(metas[1].shape), dim))


@dataclass(frozen=True)
class Ring:
    """One use's collective matmul: its collective's seconds, forward and backward, and the ``(n - 1) / n`` of
    its matmul's passes that can hide them (``ahead``, ``behind``); ``gathers``: an all-gather into the
    matmul, which backward's ring can gather again (a regathered input)."""

    forward: float
    ahead: float
    backward: float
    behind: float
    gathers: bool


def ring(lone, producer, made, consumer, strategy, i: int, sole_use: bool, mesh, profile,
         training: bool) -> Ring | None:
    """The `Ring` of a use whose collective a matmul can hide, else None.

    ``lone`` is `lone_collective` of the use's steps; ``producer``/``made`` and
    ``consumer``/``strategy`` are the two ops and their strategies (``consumer``
    ``None`` for a program output); ``sole_use``: the producer's output has no
    other use.
    """
    if lone is None:
        return None
    step, forward, backward = lone
    gathers = (step.forward_kind == ALL_GATHER and consumer is not None and i == 0
               and _rows_of(consumer, step.dim) and not any(isinstance(p, Partial) for p in strategy.out))
    if gathers:
        matmul, chosen = consumer, strategy
    elif step.kind == REDUCE_SCATTER and sole_use and _rows_of(producer, step.dim):
        matmul, chosen = producer, made
    else:
        return None
    share = (mesh.shape[step.axis] - 1) / mesh.shape[step.axis]
    return Ring(forward, share * forward_time_s(matmul, chosen, mesh, profile), backward,
                share * backward_time_s(matmul, chosen, mesh, profile, training), gathers)


def hidden_s(use: Ring | None, again: float = 0.0) -> tuple[float, float]:
    """The seconds of a use's collectives, forward and backward, that its collective matmul hides, and of
    ``again`` (its gather run again in backward, regathered) what the same ring hides besides; ``(0, 0)``
    where none serves it."""
    if use is None:
        return 0.0, 0.0
    hidden = min(use.forward, use.ahead) + min(use.backward, use.behind)
    extra = min(use.backward + again, use.behind) - min(use.backward, use.behind) if use.gathers else 0.0
    return hidden, extra


def fused_shares(uses: list[Ring], again: float = 0.0) -> tuple[float, float, float]:
    """The fractions of each use's ``ahead``, ``behind`` and (regathered) ``behind`` to credit when one ring
    serves several uses of a gathered tensor (q, k and v), whichever of them turn out to need it.

    ``uses``: per use, its largest `Ring` over the choices that need this
    gather. The ring hides ``min(collective, sum of the needing uses' matmul
    time)``; crediting each use ``ahead * min(1, forward / sum of ahead)``
    never exceeds that for any subset of the uses (each term is at most its own
    ``ahead``, and all of them together at most ``forward``), and equals it
    when every use needs the gather, so the credit adds up use by use, as the
    ILP's pieces do.
    """
    forward, backward = max(u.forward for u in uses), max(u.backward for u in uses)
    ahead, behind = sum(u.ahead for u in uses), sum(u.behind for u in uses)

    def share(collective: float, cover: float) -> float:
        return min(1.0, collective / cover) if cover > 0 else 0.0

    return share(forward, ahead), share(backward, behind), share(backward + again, behind)
