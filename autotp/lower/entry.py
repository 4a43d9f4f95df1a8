"""A program input given whole or as this rank's piece: the lowered module accepts both.

With a batch split over a data-parallel axis, each rank needs only its own
rows, so it may be handed just those (as `DistributedSampler` hands each DDP
rank its own batch); the same module still takes the whole batch and cuts
its piece itself. The input's shape says which was given.
"""

from __future__ import annotations

import torch
from torch import nn

from autotp.errors import PlanError


class InputEntry(nn.Module):
    """Cut a whole input to this rank's piece (``slices``, local slices with their autograd duals); pass a piece."""

    def __init__(self, name: str, full_shape, local_shape, slices):
        super().__init__()
        self.name, self.full_shape, self.local_shape = name, tuple(full_shape), tuple(local_shape)
        self.slices = nn.ModuleList(slices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(x.shape)
        if shape == self.full_shape:
            for cut in self.slices:
                x = cut(x)
            return x
        if shape == self.local_shape:
            return x
        raise PlanError(f"input {self.name!r} has shape {list(shape)}: the plan takes it whole "
                        f"{list(self.full_shape)} or as this rank's piece {list(self.local_shape)} "
                        "(autotp.runtime.local_inputs cuts a batch for each rank); re-plan for other shapes")

    def extra_repr(self) -> str:
        return f"whole {list(self.full_shape)} or this rank's piece {list(self.local_shape)}"
