"""Stage 7: process groups from a mesh, local multi-process launch."""

from autotp.runtime.groups import mesh_groups
from autotp.runtime.spawn import spawn

__all__ = ["mesh_groups", "spawn"]
