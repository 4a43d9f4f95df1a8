"""Where the ILP's problem credits collective matmuls: the collective seconds a matmul hides.

The credit (`autotp.cost.collective_matmul`) is already taken off the costs of
the pieces it lives on (a group's choice, an edge's pair of choices, a
fan-out's item), so the ILP minimises the step with it; this keeps a copy,
per piece, so that a plan can report how much of its collectives' time the
matmuls hide (``predicted["overlap_hidden_s"]``,
`autotp.solve.step.matmul_hidden_s`), and its compute plus its collectives
less everything hidden is still its step time.

A fan-out's item is credited the least any of its possible uses would hide:
the lowering fuses the collective with its first user in program order, which
is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hidden:
    """Seconds hidden behind matmuls: per group choice, per edge pair, per fan-out item ``(fan-out, item)``."""

    groups: dict[str, list[float]] = field(default_factory=dict)
    edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    items: dict[tuple[int, int], float] = field(default_factory=dict)

    def add_group(self, group, choice: int, seconds: float) -> None:
        if seconds:
            self.groups.setdefault(group.leader, [0.0] * group.n)[choice] += seconds

    def add_pair(self, gu: str, gv: str, nu: int, nv: int, cu: int, cv: int, seconds: float) -> None:
        if seconds:
            self.edges.setdefault((gu, gv), [[0.0] * nv for _ in range(nu)])[cu][cv] += seconds

    def set_item(self, fanout: int, item: int, seconds: float) -> None:
        if seconds:
            self.items[fanout, item] = seconds

