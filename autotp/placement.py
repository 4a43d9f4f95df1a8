"""Placements of a tensor on one mesh axis: ``Shard(dim)``, ``Replicate()``, ``Partial()``.

A tensor's layout on an N-D mesh is one placement per mesh *axis*; ``dim`` always
means a tensor dimension. ``repr`` is exact (``Shard(dim=0)``) and ``str`` is the
short form used in plans and tables (``S(0)``, ``R``, ``P``).

The autograd dual of each placement, which the lowering relies on:

- the gradient of an ``S(d)`` tensor is ``S(d)``;
- the gradient of a ``P`` tensor is ``R`` (d sum / d part = 1 on every device);
- the gradient of an ``R`` tensor must be ``R``; when a consumer's local backward
  yields a partial gradient instead, an all-reduce is inserted (Megatron's *f*).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Union

from autotp.errors import PlacementError


@dataclass(frozen=True)
class Shard:
    """Split along tensor dimension ``dim`` in contiguous, equal chunks (``torch.chunk`` order)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every device holds the full tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every device holds a same-shaped addend; the tensor is their sum."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]
R = Replicate()
P = Partial()
Layout = tuple  # tuple[Placement, ...], one per mesh axis

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")


def parse_placement(text: str) -> Placement:
    """``"S(1)"`` -> ``Shard(1)``, ``"R"`` -> ``Replicate()``, ``"P"`` -> ``Partial()``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    m = _SHARD_RE.match(text)
    if not m:
        raise PlacementError(f"placement {text!r} is not one of 'R', 'P' or 'S(<dim>)'")
    return Shard(int(m.group(1)))


def layout_str(layout) -> tuple[str, ...]:
    return tuple(str(p) for p in layout)


def parse_layout(texts) -> tuple[Placement, ...]:
    return tuple(parse_placement(t) for t in texts)


def shard_factor(layout, dim: int, mesh_shape) -> int:
    """How many pieces ``dim`` is cut into: the product of the sizes of the axes sharding it."""
    return math.prod(n for p, n in zip(layout, mesh_shape) if isinstance(p, Shard) and p.dim == dim)


def local_shape(shape, layout, mesh_shape) -> tuple[int, ...]:
    """Shape of one device's piece of a tensor of global ``shape`` (even splits only).

    One pass over the mesh axes: this sits under every edge cost of the ILP.
    """
    out = list(shape)
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard) and 0 <= p.dim < len(out):
            out[p.dim] //= n
    return tuple(out)


def local_bytes(meta, layout, mesh_shape) -> int:
    """Bytes of one device's piece of a tensor described by ``meta`` (shape and dtype)."""
    return math.prod(local_shape(meta.shape, layout, mesh_shape)) * meta.dtype.itemsize


def divides(shape, layout, mesh_shape) -> bool:
    """True when every sharded dim exists and splits evenly (autotp offers even splits only)."""
    for p in layout:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            return False
    return all(s % shard_factor(layout, d, mesh_shape) == 0 for d, s in enumerate(shape))


def shard_cuts(layout, mesh_shape, coords) -> tuple[tuple[int, int, int], ...]:
    """How to cut the device at ``coords``'s piece out of a whole tensor: ``(dim, pieces, which)`` per split dim."""
    dims = sorted({p.dim for p in layout if isinstance(p, Shard)})
    return tuple((d, shard_factor(layout, d, mesh_shape), shard_index(layout, d, coords, mesh_shape)) for d in dims)


def cut_piece(full, cuts):
    """The piece `shard_cuts` describes, as a view of ``full`` (plain tensor code: torch.compile traces it)."""
    for dim, pieces, which in cuts:
        full = full.chunk(pieces, dim=dim)[which]
    return full


def shard_index(layout, dim: int, coords, mesh_shape) -> int:
    """Which chunk of ``dim`` the device at ``coords`` holds, nesting axes in mesh order.

    With ``(S(0), S(0))`` on a 2x2 mesh, device (1, 0) holds chunk 2 of 4: the
    outer axis picks a half, the inner axis a half of that, as DTensor does.
    """
    index = 0
    for p, c, n in zip(layout, coords, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            index = index * n + c
    return index
