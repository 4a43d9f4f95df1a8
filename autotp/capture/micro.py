"""Micro-batches: the example batch of one optimizer step, cut along dim 0 into k equal pieces.

The batch is the first tensor input's dim 0; every tensor input whose dim 0
is the batch is cut, anything else (a mask shared by every row, a plain
value) is passed to each micro-batch whole.

    ids [8, 128], labels [8, 128], k = 4 -> 4 micro-batches of ids [2, 128], labels [2, 128]
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """Dim 0 of the first tensor input with one, or None."""
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()), None)
    return None if first is None else first.shape[0]


def divisors(n: int) -> list[int]:
    """The numbers of micro-batches a batch of ``n`` can be cut into evenly, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def micro_batch(args: tuple, kwargs: dict, k: int, index: int = 0, batch: int | None = None,
                leaves: bool = True) -> tuple[tuple, dict]:
    """Micro-batch ``index`` of ``k``: every tensor whose dim 0 is ``batch`` (by default the batch) cut to 1/k.

    ``leaves``: each piece a new leaf tensor (example inputs to capture), at
    ``k = 1`` too, so that every count's capture sees the same inputs (two
    arguments passed the same tensor, ``labels=input_ids``, are two pieces:
    export would wire one placeholder's uses to the other), as `parallelize`
    does; else a view, through which gradients reach the caller's tensors.
    """
    batch = batch_size(args, kwargs) if batch is None else batch
    if batch is None or (k == 1 and not leaves):
        return tuple(args), dict(kwargs)
    size = batch // k

    def cut(value):
        if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch):
            return value
        if not leaves:
            return value[index * size:(index + 1) * size]
        piece = value.detach()[index * size:(index + 1) * size].clone()
        return piece.requires_grad_() if value.requires_grad else piece

    return pytree.tree_map(cut, (tuple(args), dict(kwargs)))
