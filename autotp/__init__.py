"""autotp: automatic tensor parallelism for PyTorch.

    plan = autotp.plan(model, autotp.Mesh("4"), example_inputs=(x,))
    local = autotp.parallelize(model, plan)      # on every rank of a process group
"""

from autotp.api import parallelize, plan
from autotp.cost.profile import Profile, load_profile
from autotp.errors import AutotpError
from autotp.mesh import Mesh
from autotp.placement import Partial, Replicate, Shard
from autotp.solve.plan import Plan

__all__ = ["plan", "parallelize", "Mesh", "Plan", "Shard", "Replicate", "Partial", "Profile", "load_profile",
           "AutotpError"]
__version__ = "0.1.0"
