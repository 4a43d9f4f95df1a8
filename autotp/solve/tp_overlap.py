"""Where the ILP's problem credits collective matmuls: the collective seconds a matmul hides.

The credit (`autotp.cost.collective_matmul`) is already taken off the costs of
the pieces it lives on (a group's choice, an edge's pair of choices), so the
ILP minimises the step with it; this keeps a copy,
per piece, so that a plan can report how much of its collectives' time the
matmuls hide (``predicted["overlap_hidden_s"]``,
`autotp.solve.step.matmul_hidden_s`), and its compute plus its collectives
less everything hidden is still its step time.

A gather with several uses (a fan-out's item) runs as one ring for all of
its matmuls; each use that needs it is credited its share
(`autotp.cost.collective_matmul.fused_shares`) on its own pair of choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hidden:
    """Seconds hidden behind matmuls: per group choice and per edge pair."""

    groups: dict[str, list[float]] = field(default_factory=dict)
    edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)

    def add_group(self, group, choice: int, seconds: float) -> None:
        if seconds:
            self.groups.setdefault(group.leader, [0.0] * group.n)[choice] += seconds

    def add_pair(self, gu: str, gv: str, nu: int, nv: int, cu: int, cv: int, seconds: float) -> None:
        if seconds:
            self.edges.setdefault((gu, gv), [[0.0] * nv for _ in range(nu)])[cu][cv] += seconds

