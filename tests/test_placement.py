"""Placement strings, local shapes and DTensor's nesting of a dim split on two axes."""

from __future__ import annotations

import pytest
import torch

from autotp import Partial, Replicate, Shard
from autotp.errors import PlacementError
from autotp.lower import shard_tensor
from autotp.placement import divides, local_shape, parse_placement


def test_str_and_repr():
    assert str(Shard(1)) == "S(1)" and repr(Shard(1)) == "Shard(dim=1)"
    assert str(Replicate()) == "R" and str(Partial()) == "P"
    assert parse_placement("S(2)") == Shard(2) and parse_placement("R") == Replicate()
    with pytest.raises(PlacementError, match="not one of"):
        parse_placement("X")


def test_local_shape_and_divisibility():
    assert local_shape((8, 6), (Shard(0), Shard(1)), (2, 3)) == (4, 2)
    assert local_shape((8, 6), (Shard(0), Shard(0)), (2, 2)) == (2, 6)
    assert not divides((6, 5), (Shard(1),), (2,))
    assert not divides((6,), (Shard(1),), (2,))


def test_nested_shards_match_dtensor_order():
    """(S(0), S(0)) on a 2x2 mesh: device (i, j) holds chunk 2*i + j, as DTensor does."""
    full = torch.arange(8)
    for i in range(2):
        for j in range(2):
            piece = shard_tensor(full, (Shard(0), Shard(0)), (2, 2), (i, j))
            assert piece.tolist() == full.chunk(4)[2 * i + j].tolist()
