"""Process groups for a `Mesh`: one group per mesh axis that contains this rank."""

from __future__ import annotations

import torch.distributed as dist

from autotp.errors import MeshError


def mesh_groups(mesh, rank: int | None = None) -> dict:
    """Mesh axis -> process group for this rank, created collectively on every rank.

    Every rank must call this with the same mesh: ``new_group`` is collective.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("no process group is initialised: call torch.distributed.init_process_group "
                        "(or run under torchrun / autotp.runtime.spawn) before autotp.parallelize")
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(f"the mesh {mesh} has {mesh.size} devices but the process group has {world} ranks: "
                        f"plan for Mesh('{world}') or launch {mesh.size} processes")
    rank = dist.get_rank() if rank is None else rank
    groups = {}
    for axis in range(mesh.ndim):
        if mesh.ndim == 1:
            groups[axis] = dist.group.WORLD
            continue
        for ranks in mesh.axis_groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[axis] = group
    return groups
