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


def device_mesh_groups(device_mesh, mesh) -> tuple[dict, int]:
    """``(groups, rank)`` for running a plan of ``mesh`` on a torch ``DeviceMesh``: each axis's process group,
    the group of the whole mesh (for flat sums over every axis) and this rank's index in the mesh, which
    may be a sub-mesh of a larger world (the world's other ranks run other work, or other replicas)."""
    if tuple(device_mesh.shape) != tuple(mesh.shape):
        raise MeshError(f"the device mesh has shape {tuple(device_mesh.shape)} but the plan is for {mesh}: plan for "
                        "this mesh (autotp.plan accepts the DeviceMesh itself)")
    coords = device_mesh.get_coordinate()
    if coords is None:
        raise MeshError(f"rank {dist.get_rank()} is not in the device mesh {device_mesh.mesh.tolist()}: call "
                        "parallelize only on the mesh's ranks")
    groups = {axis: device_mesh.get_group(axis) for axis in range(mesh.ndim)}
    every = tuple(range(mesh.ndim))
    groups[every] = groups[0] if mesh.ndim == 1 else device_mesh._flatten().get_group()
    return groups, mesh.rank_of(coords)
