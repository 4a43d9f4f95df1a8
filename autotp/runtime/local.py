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
    """``(args, kwargs)`` with each tensor cut to ``rank``'s piece of its ``plan.io`` layout (whole where R).

    Positional tensors are matched to the plan's inputs in order, keyword
    tensors by name, so keywords may come in any order. A plan without
    ``io`` (saved before version 4) takes every input whole: they are
    returned as given.
    """
    entries = plan.io.get("inputs", [])
    by_name = {name: layout for name, layout in entries}
    in_order = iter(layout for _, layout in entries)
    coords = plan.mesh.coords(rank)

    def cut(value, layout):
        if not isinstance(value, torch.Tensor) or layout is None:
            return value
        return shard_tensor(value, parse_layout(layout), plan.mesh.shape, coords)

    leaves, spec = pytree.tree_flatten(tuple(args))
    args = pytree.tree_unflatten([cut(v, next(in_order, None)) if isinstance(v, torch.Tensor) else v
                                  for v in leaves], spec)
    return args, {k: cut(v, by_name.get(k)) for k, v in (kwargs or {}).items()}
