"""Exception classes: one per kind of bad input, each naming the problem and the way out.

Every error autotp raises on purpose derives from :class:`AutotpError`, so a
caller (and the CLI) can tell "you asked for something impossible" apart from a
bug, and print a one-line message instead of a traceback.
"""


class AutotpError(Exception):
    """Base class of every error autotp raises on purpose."""


class MeshError(AutotpError, ValueError):
    """A mesh string, shape, axis name or link class is malformed."""


class PlacementError(AutotpError, ValueError):
    """A placement string such as ``S(0)`` could not be parsed or does not fit a tensor."""


class ProfileError(AutotpError, ValueError):
    """A hardware profile is missing, malformed, or has a field out of range."""


class CaptureError(AutotpError, RuntimeError):
    """``torch.export`` could not capture the model with the given example inputs."""


class PlanError(AutotpError, ValueError):
    """A plan does not fit the model, the mesh or the process group it is used with."""


class MemoryLimitError(PlanError):
    """No plan fits the per-device memory limit."""


class SolverError(AutotpError, RuntimeError):
    """The ILP solver did not return a feasible plan."""
