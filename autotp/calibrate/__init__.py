"""Measure the hardware at hand and write a profile (`autotp calibrate`)."""

from autotp.calibrate.run import DEFAULT_SIZES, calibrate, write_profile

__all__ = ["calibrate", "write_profile", "DEFAULT_SIZES"]
