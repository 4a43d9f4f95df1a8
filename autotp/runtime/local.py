"""Each rank's own piece of a batch, as the plan lets it take its inputs (``plan.io["inputs"]``).

With a batch split over a data-parallel axis a rank needs only its own rows,
as each DDP rank reads only its own batch through ``DistributedSampler``. A
data loader per rank can do that itself (rows ``r * b / n`` to ``(r + 1) * b / n``
of the global batch on the rank's data-parallel coordinates); `local_inputs`
cuts a whole batch the same way, for tests and for loaders that read it all.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autotp.lower import shard_tensor
from autotp.placement import parse_layout


def local_inputs(plan, rank: int, args: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each tensor cut to ``rank``'s piece of its ``plan.io`` layout (whole where R)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    layouts = iter(layout for _, layout in plan.io.get("inputs", []))
    coords = plan.mesh.coords(rank)
    cut = [shard_tensor(leaf, parse_layout(next(layouts)), plan.mesh.shape, coords)
           if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return pytree.tree_unflatten(cut, spec)
