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


class DtypeError(AutotpError, ValueError):
    """A tensor or a dtype name uses a dtype autotp cannot cost or shard (complex, float8, a typo)."""


class InputError(CaptureError):
    """The example inputs do not match the model's ``forward`` (count, names, shapes or dtypes)."""


class RankFailedError(AutotpError, RuntimeError):
    """A rank of a spawned process group raised, died, or did not finish in time; the others were stopped."""


class SolverGapWarning(UserWarning):
    """The solver hit its time limit: the plan is the best found, within the stated optimality gap."""


class ModelSpecError(AutotpError, ValueError):
    """A model named on the command line (file, transformers architecture or plan) cannot be built."""


class MaterializeError(AutotpError, ValueError):
    """Weights to materialise a model from are missing a tensor, have another shape, or are unreadable."""


class CheckpointError(AutotpError, ValueError):
    """A sharded checkpoint is missing, incomplete, or was saved for another plan or mesh."""
