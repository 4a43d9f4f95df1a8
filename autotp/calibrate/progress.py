"""The progress bar calibration draws; it lives in `autotp.progress` with the stage reporter."""

from autotp.progress import Progress

__all__ = ["Progress"]
