"""experts (`autotp.capture.experts`): split the tokens, the experts, both (expert parallelism), or each expert.

Inputs: hidden (tokens, h), index and weights (tokens, k), gate_up
(experts, 2 * inner, h), down (experts, h, inner). Per mesh axis:

* tokens split, every expert whole: data parallelism, the op itself on the
  device's tokens;
* experts split, tokens whole: each device runs its own experts for every
  token and leaves the others' rows zero, a partial sum (no exchange of
  tokens; the sum is the planner's usual all-reduce or reduce-scatter);
* experts and tokens split (expert parallelism, as in GShard and
  DeepSpeed-MoE): each device sends each of its (token, expert) pairs to the
  expert's owner by all-to-all, the owner runs it, and a second all-to-all
  brings the result back, where the routing weights sum it. Loads may be
  uneven: the counts are exchanged first, so nothing is dropped;
* each expert's FFN split by its inner dim, tokens whole (tensor parallelism
  inside the experts, Megatron's MLP in every expert; ``impl``
  ``expert_columns``): down by its rows (``S(2)``), and of ``gate_up``, whose
  gate and up halves no even split keeps together, each device reads its
  columns of both halves from the whole parameter (``R``; its gradient then
  arrives in those rows only, a partial sum the planner reduces); the output
  is a partial sum.

An expert split over several axes is owned by one device of their product.
"""

from __future__ import annotations

import math

from autotp.placement import Shard, local_shape
from autotp.strategies.base import AxisOption, P, R

EXPERT_PARALLEL = "expert_parallel"
EXPERT_COLUMNS = "expert_columns"
TOKENS, INDEX, WEIGHTS, GATE_UP, DOWN = range(5)  # the op's tensor inputs


def experts_rule(op):
    tokens, experts = op.in_metas[TOKENS].shape[0], op.in_metas[GATE_UP].shape[0]
    options = []
    if tokens > 1:
        options.append(AxisOption(Shard(0), (Shard(0),) * 3 + (R, R)))
    if experts > 1:
        options.append(AxisOption(P, (R,) * 3 + (Shard(0),) * 2, impl=EXPERT_PARALLEL))
    if tokens > 1 and experts > 1:
        options.append(AxisOption(Shard(0), (Shard(0),) * 5, impl=EXPERT_PARALLEL))
    if op.in_metas[DOWN].shape[2] > 1:
        options.append(AxisOption(P, (R,) * 4 + (Shard(2),), impl=EXPERT_COLUMNS))
    return options


def routed_axes(strategy) -> tuple[int, ...]:
    """The mesh axes whose devices exchange (token, expert) pairs by all-to-all: tokens and experts both split."""
    return tuple(a for a, (t, e) in enumerate(zip(strategy.ins[TOKENS], strategy.ins[GATE_UP]))
                 if isinstance(t, Shard) and isinstance(e, Shard))


def routed_bytes(op, strategy, mesh_shape) -> int:
    """Bytes one device sends in each all-to-all of a routing axis: a hidden vector per local (token, expert)
    pair, taken as spread evenly over the devices that own the experts."""
    pairs = math.prod(local_shape(op.in_metas[INDEX].shape, strategy.ins[INDEX], mesh_shape))
    return pairs * op.in_metas[TOKENS].shape[-1] * op.in_metas[TOKENS].dtype.itemsize


def work_share(strategy, mesh_shape) -> float:
    """The share of all (token, expert) pairs one device computes: each axis that splits tokens, experts (or
    both, routing the pairs) or each expert's FFN (``down`` by its rows) divides the work once."""
    axes = [a for a in range(len(mesh_shape)) if any(isinstance(strategy.ins[i][a], Shard) for i in (TOKENS, DOWN))]
    return 1.0 / math.prod(mesh_shape[a] for a in axes)
