"""Stage 7: process groups from a mesh, local multi-process launch."""

from autotp.runtime.groups import mesh_groups
from autotp.runtime.local import local_inputs
from autotp.runtime.spawn import spawn

__all__ = ["local_inputs", "mesh_groups", "spawn"]
