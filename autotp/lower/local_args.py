"""Rewrite an op's non-tensor arguments for local shapes: the size lists of views and expands.

``view(x, [2, 8, 4, 16])`` on a head-split ``S(2)`` over 4 devices becomes
``view(x_local, [2, 8, 1, 16])``. Every other supported op takes dims, not
sizes, or is only split on dims its size arguments do not mention.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
SHAPE_ARG_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default})


_AS_RESHAPE = {aten.view.default, aten._unsafe_view.default}


def local_target(target):
    """``view`` becomes ``reshape`` in the lowered program.

    A view was valid for the strides seen at capture; a kernel may lay out its
    local output differently (CPU attention does), and ``reshape`` is the same
    function whenever the view was valid, copying only when it must.
    """
    return aten.reshape.default if target in _AS_RESHAPE else target


def localize_args(target, args: tuple, local_out_shape) -> tuple:
    """``args`` with the size list replaced by the local output shape, for ops that take one."""
    if target in SHAPE_ARG_OPS:
        return (args[0], list(local_out_shape)) + tuple(args[2:])
    return args
