"""`Mesh`: the logical device grid a model is planned for (sizes, axis names, link classes).

A mesh is pure data: it creates no process group. Ranks map to mesh coordinates
in row-major order, as in ``torch.distributed.device_mesh.init_device_mesh``, so
on ``Mesh("2x4")`` rank 5 sits at coordinate ``(1, 1)``.

    >>> Mesh("2x4", links="ethernet,nvlink")
    Mesh(shape=(2, 4), names=('axis0', 'axis1'), links=('ethernet', 'nvlink'))

Axes are named ``axis0``, ``axis1``, ... unless named: a name such as ``dp``
or ``tp`` would claim a role, and the planner gives each axis whatever role
is fastest (the batch, the weights, both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from autotp.errors import MeshError

LINK_CLASSES = ("nvlink", "pcie", "infiniband", "ethernet", "loopback")


def _parse_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(shape, str):
        parts = shape.lower().replace("×", "x").split("x")
        if not all(p.strip().isdigit() for p in parts):
            raise MeshError(f"mesh {shape!r} is not of the form '4' or '2x4': write the axis sizes joined by 'x'")
        shape = tuple(int(p) for p in parts)
    try:
        shape = tuple(shape)
    except TypeError:  # a float or another scalar: not a shape at all
        raise MeshError(f"mesh shape {shape!r} must be a size (4), a string ('2x4') or a tuple of sizes "
                        "((2, 4))") from None
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
        raise MeshError(f"mesh shape {shape!r} must be one or more positive integers, e.g. (2, 4)")
    return shape


def _parse_links(links, ndim: int) -> tuple[str, ...]:
    if links is None:
        links = ("nvlink",) * ndim
    if isinstance(links, str):
        links = tuple(l.strip() for l in links.split(","))
        if len(links) == 1:
            links = links * ndim
    links = tuple(links)
    if len(links) != ndim:
        raise MeshError(f"mesh has {ndim} axes but {len(links)} link classes {links}: give one per axis")
    for link in links:
        if link not in LINK_CLASSES:
            raise MeshError(f"unknown link class {link!r}: use one of {', '.join(LINK_CLASSES)}")
    return links


@dataclass(frozen=True, init=False)
class Mesh:
    """A device grid: ``shape`` per axis, an axis ``names`` tuple and one link class per axis."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    links: tuple[str, ...]

    def __init__(self, shape, names=None, links=None):
        shape = _parse_shape(shape)
        if names is None:
            names = tuple(f"axis{i}" for i in range(len(shape)))
        names = tuple(names)
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise MeshError(f"mesh of shape {shape} needs {len(shape)} distinct axis names, got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "links", _parse_links(links, len(shape)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of ``rank``: the last axis varies fastest."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside a mesh of {self.size} devices")
        out = []
        for n in reversed(self.shape):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank_of(self, coords) -> int:
        rank = 0
        for c, n in zip(coords, self.shape):
            rank = rank * n + c
        return rank

    def axis_groups(self, axis: int) -> list[list[int]]:
        """All rank groups along ``axis``, in a fixed order every rank agrees on.

        On ``Mesh("2x4")`` axis 1 gives ``[[0,1,2,3],[4,5,6,7]]`` and axis 0 gives
        ``[[0,4],[1,5],[2,6],[3,7]]``.
        """
        others = [range(n) if a != axis else [0] for a, n in enumerate(self.shape)]
        groups = []
        for base in product(*others):
            groups.append([self.rank_of(base[:axis] + (i,) + base[axis + 1:]) for i in range(self.shape[axis])])
        return groups

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names), "links": list(self.links)}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        return cls(tuple(d["shape"]), names=d["names"], links=d["links"])

    @classmethod
    def from_device_mesh(cls, device_mesh, links=None) -> "Mesh":
        """The mesh of a torch ``DeviceMesh``: its shape and dim names (the defaults when it has none), and
        ``links``, one link class per axis, as for ``Mesh`` (default nvlink) -- torch's mesh does not say them."""
        return cls(tuple(device_mesh.shape), names=device_mesh.mesh_dim_names, links=links)

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}:{l}" for n, s, l in zip(self.names, self.shape, self.links))
        return f"Mesh({axes})"
