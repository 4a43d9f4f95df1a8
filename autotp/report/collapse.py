"""Fold rows of identical layers into one: ``model.layers.*.self_attn.q_proj.weight  S(0)  ×32``.

Names that differ only in their layer indices, and carry the same values, make
one row. When some layers differ from the rest, each group of layers names the
indices it covers (``model.layers.[0-30].mlp``), so nothing is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.capture.scopes import layer_indices, layer_pattern


@dataclass(frozen=True)
class Row:
    """One line of a table: a (possibly collapsed) name, its values, and how many originals it stands for."""

    name: str
    values: tuple
    count: int = 1


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, run = [], []
    for i in sorted(set(indices)):
        if run and i != run[-1] + 1:
            out.append(_run(run))
            run = []
        run.append(i)
    if run:
        out.append(_run(run))
    return ",".join(out)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def collapse(items: list[tuple[str, tuple]]) -> list[Row]:
    """``[(name, values)]`` in order -> rows, identical layers folded, in order of first appearance."""
    groups: dict[tuple[str, tuple], list[str]] = {}
    layers: dict[str, set] = {}  # pattern -> every layer index tuple it occurs with
    for name, values in items:
        pattern = layer_pattern(name)
        groups.setdefault((pattern, values), []).append(name)
        layers.setdefault(pattern, set()).add(layer_indices(name))
    rows = []
    for (pattern, values), names in groups.items():
        if len(names) == 1:
            rows.append(Row(names[0], values, 1))
        elif {layer_indices(n) for n in names} == layers[pattern] or pattern.count("*") != 1:
            rows.append(Row(pattern, values, len(names)))
        else:
            which = index_ranges([layer_indices(n)[0] for n in names])
            rows.append(Row(pattern.replace("*", f"[{which}]"), values, len(names)))
    return rows
