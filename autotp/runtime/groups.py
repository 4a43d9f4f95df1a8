"""Process groups for a `Mesh`: one group per mesh axis that contains this rank."""

from __future__ import annotations

import torch.distributed as dist

from autotp.errors import MeshError


def plan_device_mesh(mesh, device_type: str = "cpu"):
    """A torch ``DeviceMesh`` of ``mesh``'s shape and axis names over the whole world, created collectively on
    every rank (``init_device_mesh``: its groups carry the collectives, its mesh the DTensor parameters)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise MeshError("no process group is initialised: call torch.distributed.init_process_group "
                        "(or run under torchrun / autotp.runtime.spawn) before autotp.parallelize")
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(f"the mesh {mesh} has {mesh.size} devices but the process group has {world} ranks: "
                        f"plan for Mesh('{world}'), launch {mesh.size} processes, or pass parallelize a "
                        "device_mesh of the plan's shape")
    return init_device_mesh(device_type, tuple(mesh.shape), mesh_dim_names=tuple(mesh.names))


def mesh_groups(mesh, device_type: str = "cpu") -> dict:
    """Mesh axis -> process group for this rank (and the whole mesh's group under the tuple of every axis),
    from `plan_device_mesh`: collective, every rank calls it with the same mesh."""
    return device_mesh_groups(plan_device_mesh(mesh, device_type), mesh)[0]


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
