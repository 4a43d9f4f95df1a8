"""Stage 7: process groups from a mesh, local multi-process launch, the optimizer of a rank module."""

from autotp.runtime.groups import mesh_groups
from autotp.runtime.local import local_inputs
from autotp.runtime.optimizer import shard_optimizer
from autotp.runtime.spawn import spawn

__all__ = ["local_inputs", "mesh_groups", "shard_optimizer", "spawn"]
