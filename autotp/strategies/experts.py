"""experts (`autotp.capture.experts`): split the tokens, the experts, both (expert parallelism), or each expert.

Inputs: hidden (tokens, h), index and weights (tokens, k), gate and up
(experts, inner, h), down (experts, h, inner). Per mesh axis:

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
  inside the experts, Megatron's MLP in every expert): gate and up by
  columns, down by rows, a partial sum; the op itself on the local slices.

An expert split over several axes is owned by one device of their product.
"""

from __future__ import annotations

import math

from autotp.placement import Shard
from autotp.strategies.base import AxisOption, P, R

EXPERT_PARALLEL = "expert_parallel"
TOKENS, INDEX, WEIGHTS, GATE, UP, DOWN = range(6)  # the op's tensor inputs


def experts_rule(op):
    tokens, (experts, inner, _) = op.in_metas[TOKENS].shape[0], op.in_metas[GATE].shape
    options = []
    if tokens > 1:
        options.append(AxisOption(Shard(0), (Shard(0),) * 3 + (R,) * 3))
    if experts > 1:
        options.append(AxisOption(P, (R,) * 3 + (Shard(0),) * 3, impl=EXPERT_PARALLEL))
    if tokens > 1 and experts > 1:
        options.append(AxisOption(Shard(0), (Shard(0),) * 6, impl=EXPERT_PARALLEL))
    if inner > 1:
        options.append(AxisOption(P, (R,) * 3 + (Shard(1), Shard(1), Shard(2))))
    return options


def routed_axes(strategy) -> tuple[int, ...]:
    """The mesh axes whose devices exchange (token, expert) pairs by all-to-all: tokens and experts both split."""
    return tuple(a for a, (t, e) in enumerate(zip(strategy.ins[TOKENS], strategy.ins[GATE]))
                 if isinstance(t, Shard) and e == Shard(0))


def work_share(strategy, mesh_shape) -> float:
    """The share of all (token, expert) pairs one device computes: each axis that splits tokens, experts (or
    both, routing the pairs) or each expert's FFN divides the work once."""
    axes = [a for a in range(len(mesh_shape))
            if isinstance(strategy.ins[TOKENS][a], Shard) or isinstance(strategy.ins[GATE][a], Shard)]
    return 1.0 / math.prod(mesh_shape[a] for a in axes)
