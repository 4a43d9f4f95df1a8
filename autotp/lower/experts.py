"""Experts split on one device: its own experts for the (token, expert) pairs routed to it, or its columns of
every expert.

The strategy (`autotp.strategies.experts`) splits the experts over some mesh
axes. On an axis where the tokens are split too, each pair travels to the
device that owns its expert by all-to-all and its result comes back the same
way (`_routed`); on an axis where they are whole, every device has every pair
and keeps those of its own experts, a partial sum.

Loads are uneven and change every step: each all-to-all is preceded by one of
the counts, so every pair arrives and none is dropped (no capacity factor).
The all-to-alls are torch's functional, autograd-aware ones, so backward sends
the gradients back along the same routes. The routing weights multiply the
results where the tokens live, so their gradients never travel. The counts
are read on the host (``tolist``), which a compiled graph breaks at.

Split inside the experts (`ExpertColumns`), a device runs every expert on its
columns of the FFN: its slice of the gate half and of the up half of the
whole ``gate_up`` weight, and its rows of ``down``; the result is a partial
sum over the devices, as a Megatron MLP's is.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from autotp.capture.experts import expert_sum
from autotp.placement import Shard, shard_factor, shard_index
from autotp.strategies.experts import DOWN, GATE_UP, TOKENS


class ExpertParallel(nn.Module):
    """`autotp.capture.experts.experts` with this device's experts ``first`` to ``first + count - 1``, routing
    pairs over ``routes`` (the `AxisComm` of each axis that splits tokens and experts, outer first)."""

    def __init__(self, activation: str, first: int, count: int, routes, owner_block: tuple):
        super().__init__()
        self.activation, self.first, self.count, self.routes = activation, first, count, routes
        self.owner_block = owner_block

    def forward(self, hidden, index, weights, gate_up, down):
        if not self.routes:
            return expert_sum(hidden, index, weights, gate_up, down, self.activation, self.first)
        tokens, k = index.shape
        pair_token = torch.arange(tokens * k, device=index.device) // k
        experts = index.reshape(-1)
        results = self._routed(hidden[pair_token], experts, gate_up, down, 0)
        weighted = results * weights.reshape(-1, 1)
        return torch.zeros_like(hidden).index_add(0, pair_token, weighted.to(hidden.dtype))

    def _routed(self, rows, experts, gate_up, down, stage: int):
        """The experts' results for ``rows`` (one hidden vector per pair, its expert in ``experts``), in order,
        after routing them over ``routes[stage:]``."""
        if stage == len(self.routes):
            one = torch.ones_like(experts, dtype=rows.dtype).unsqueeze(1)  # weights of one: applied at home
            return expert_sum(rows, experts.unsqueeze(1), one, gate_up, down, self.activation, self.first)
        comm = self.routes[stage]
        owner = self._coordinate(experts, stage)
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=comm.size)
        received = funcol.wait_tensor(funcol.all_to_all_single(sent, None, None, comm.group))
        sent, received = sent.tolist(), received.tolist()
        there = funcol.wait_tensor(funcol.all_to_all_single_autograd(rows[order], received, sent, comm.group))
        their_experts = funcol.wait_tensor(funcol.all_to_all_single(experts[order], received, sent, comm.group))
        done = self._routed(there, their_experts, gate_up, down, stage + 1)
        back = funcol.wait_tensor(funcol.all_to_all_single_autograd(done, sent, received, comm.group))
        return back[torch.argsort(order)]

    def _coordinate(self, experts, stage: int):
        """The index, on route ``stage``'s axis, of the device that owns each expert (``owner_block[stage]``:
        how many consecutive experts one step along that axis spans, as `autotp.placement.shard_index` nests
        the axes that split them)."""
        return (experts // self.owner_block[stage]) % self.routes[stage].size

    def extra_repr(self) -> str:
        routes = ", ".join(c.name for c in self.routes) or "none (partial sums)"
        return f"experts {self.first}..{self.first + self.count - 1}, routed over {routes}"


def build_expert_parallel(activation: str, in_layouts, in_shapes, coords, mesh_shape, comms) -> ExpertParallel:
    """This device's `ExpertParallel` for the experts op's layouts (`autotp.strategies.experts`)."""
    experts_layout = in_layouts[GATE_UP]
    count = in_shapes[GATE_UP][0] // shard_factor(experts_layout, 0, mesh_shape)
    split = [a for a, p in enumerate(experts_layout) if isinstance(p, Shard) and mesh_shape[a] > 1]
    routed = [a for a in split if isinstance(in_layouts[TOKENS][a], Shard)]
    span = {a: count * math.prod(mesh_shape[b] for b in split if b > a) for a in split}
    return ExpertParallel(activation, shard_index(experts_layout, 0, coords, mesh_shape) * count, count,
                          [comms[a] for a in routed], tuple(span[a] for a in routed))


class ExpertColumns(nn.Module):
    """`autotp.capture.experts.experts` on columns ``start`` to ``start + width - 1`` of every expert's FFN: a
    partial sum (``down`` arrives as its rows, ``gate_up`` whole)."""

    def __init__(self, activation: str, start: int, width: int):
        super().__init__()
        self.activation, self.start, self.width = activation, start, width

    def forward(self, hidden, index, weights, gate_up, down):
        inner = gate_up.shape[1] // 2
        gate = gate_up[:, self.start:self.start + self.width]
        up = gate_up[:, inner + self.start:inner + self.start + self.width]
        return expert_sum(hidden, index, weights, torch.cat([gate, up], dim=1), down, self.activation)

    def extra_repr(self) -> str:
        return f"columns {self.start}..{self.start + self.width - 1} of every expert"


def build_expert_columns(activation: str, in_layouts, in_shapes, coords, mesh_shape) -> ExpertColumns:
    """This device's `ExpertColumns`: the columns its rows of ``down`` (split on dim 2) name."""
    width = in_shapes[DOWN][2] // shard_factor(in_layouts[DOWN], 2, mesh_shape)
    return ExpertColumns(activation, shard_index(in_layouts[DOWN], 2, coords, mesh_shape) * width, width)
