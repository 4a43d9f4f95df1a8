"""A plan as text: `Plan.summary()` is the report of `autotp.report.table` without baselines."""

from __future__ import annotations


def format_summary(plan) -> str:
    from autotp.report.table import format_plan

    return format_plan(plan)
