"""Stage 4: costs in seconds and bytes: roofline compute, alpha-beta collectives, memory."""

from autotp.cost.profile import Profile, load_profile

__all__ = ["Profile", "load_profile"]
