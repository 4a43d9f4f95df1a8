"""Stage 7: process groups from a mesh, local multi-process launch, training steps and the optimizer."""

from autotp.runtime.accumulate import accumulate
from autotp.lower.dtensor import local_tensor
from autotp.runtime.groups import mesh_groups, plan_device_mesh
from autotp.runtime.local import local_inputs
from autotp.lower.pending import wait_parameters
from autotp.runtime.optimizer import shard_optimizer
from autotp.runtime.spawn import spawn

__all__ = ["accumulate", "local_inputs", "local_tensor", "mesh_groups", "plan_device_mesh", "shard_optimizer", "spawn",
           "wait_parameters"]
