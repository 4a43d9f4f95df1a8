"""Redistribution steps: the collectives, their order on nested splits, and their backward."""

from __future__ import annotations

import pytest
import torch

from autotp.graph.opgraph import TensorMeta
from autotp.placement import P, R, Shard
from autotp.redistribute import Unsupported, plan_steps

META = TensorMeta((8, 8), torch.float32)


def kinds(steps):
    return [(s.kind, s.axis) for s in steps]


def test_single_axis_transitions():
    assert kinds(plan_steps((P,), (R,), META, (4,))) == [("all_reduce", 0)]
    assert kinds(plan_steps((P,), (Shard(1),), META, (4,))) == [("reduce_scatter", 0)]
    assert kinds(plan_steps((Shard(0),), (R,), META, (4,))) == [("all_gather", 0)]
    assert kinds(plan_steps((R,), (Shard(0),), META, (4,))) == [("slice", 0)]
    assert kinds(plan_steps((Shard(0),), (Shard(1),), META, (4,))) == [("all_gather", 0), ("slice", 0)]
    assert plan_steps((Shard(0),), (Shard(0),), META, (4,)) == []
    with pytest.raises(Unsupported):
        plan_steps((R,), (P,), META, (4,))


def test_backward_duals():
    [gather] = plan_steps((Shard(0),), (R,), META, (4,))
    assert gather.backward_kind is None  # the slice of a replicated gradient
    [slice_] = plan_steps((R,), (Shard(0),), META, (4,))
    assert slice_.backward_kind == "all_gather"
    [f] = plan_steps((R,), (R,), META, (4,), grad_axes=(0,))
    assert (f.kind, f.forward_kind, f.backward_kind) == ("grad_all_reduce", None, "all_reduce")
    [gather_rs] = plan_steps((Shard(0),), (R,), META, (4,), grad_axes=(0,))
    assert (gather_rs.forward_kind, gather_rs.backward_kind) == ("all_gather", "reduce_scatter")


def test_nested_split_is_undone_innermost_first():
    steps = plan_steps((Shard(0), Shard(0)), (R, Shard(0)), META, (2, 2))
    assert kinds(steps) == [("all_gather", 1), ("all_gather", 0), ("slice", 1)]


def test_message_bytes_follow_nccl_tests():
    [gather] = plan_steps((Shard(0),), (R,), META, (4,))
    assert gather.message_bytes == 8 * 8 * 4  # the gathered output
    [reduce] = plan_steps((P,), (R,), META, (4,))
    assert reduce.message_bytes == 8 * 8 * 4
