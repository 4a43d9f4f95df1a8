"""Stage 5: the ILP and the `Plan` it produces."""

from autotp.solve.plan import NodePlan, Plan

__all__ = ["Plan", "NodePlan"]
