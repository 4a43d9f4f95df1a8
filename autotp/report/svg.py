"""The op graph as an SVG: one row per topological depth, identical layers folded to one, collectives on edges.

Each op is a box coloured by its output placement, one stripe per mesh axis
(R grey, P orange, S(0) blue, S(1) green, ...). An edge that runs collectives
is drawn red and labelled with their kinds and message sizes (forward; the
backward ones are in the edge's tooltip). Of a stack of layers
(``model.layers.0``, ``model.layers.1``, ...) only the first is drawn, framed
and marked ``×N``; edges into and out of the others are drawn from its ops.
Written by hand: no graphviz.
"""

from __future__ import annotations

import re
from html import escape

from autotp.graph.opgraph import KIND_PARAM
from autotp.units import format_bytes

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 150, 36, 24, 40, 40
COLORS = {"R": "#d9d9d9", "P": "#f4a261"}
SHARD_COLORS = ["#5b8fd4", "#6cc070", "#a77fd6", "#46b3b3", "#d46b8f"]
_STACK = re.compile(r"^(.*?\.)(\d+)(?=\.|$)")  # "model.layers.3.mlp" -> ("model.layers.", "3")


def placement_color(placement: str) -> str:
    if placement.startswith("S("):
        return SHARD_COLORS[int(placement[2:-1]) % len(SHARD_COLORS)]
    return COLORS.get(placement, "#ffffff")


def _scope(plan, op) -> str:
    return op.fqn if op.kind == KIND_PARAM else plan.scopes.get(op.name, "")


def fold_layers(graph, plan) -> tuple[dict[str, str], dict[str, tuple[str, int]]]:
    """``(representative of each folded node, {kept layer prefix: (stack name, N)})``.

    A node in layer k > first of a stack stands for the node at the same
    position in the first layer, when the layers have the same number of nodes.
    """
    layers: dict[str, dict[int, list[str]]] = {}
    for op in graph.nodes():
        m = _STACK.match(_scope(plan, op))
        if m:
            layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(op.name)
    rep, kept = {}, {}
    for stack, by_index in layers.items():
        if len(by_index) < 2:
            continue
        first = min(by_index)
        kept[f"{stack}{first}"] = (stack.rstrip("."), len(by_index))
        for index, names in by_index.items():
            if index != first and len(names) == len(by_index[first]):
                rep.update(zip(names, by_index[first]))
    return rep, kept


def _depths(graph, visible: list[str], edges: set) -> dict[str, int]:
    """Longest-path depth of every visible op; parameters sit one row above their first consumer."""
    preds: dict[str, list[str]] = {}
    for u, v in edges:
        preds.setdefault(v, []).append(u)
    depth = {}
    for name in visible:
        if graph.node(name).kind == KIND_PARAM:
            continue
        depth[name] = max((depth.get(u, 0) + 1 for u in preds.get(name, []) if u in depth), default=0)
    for name in visible:
        if graph.node(name).kind == KIND_PARAM:
            consumers = [depth[v] for u, v in edges if u == name and v in depth]
            depth[name] = max(min(consumers, default=1) - 1, 0)
    return depth


def _edge_collectives(plan) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for c in plan.collectives:
        out.setdefault((c["producer"], c["node"]), []).append(c)
    return out


def plan_svg(plan, graph) -> str:
    """The SVG document for ``plan`` drawn over ``graph`` (its `OpGraph`)."""
    rep, kept = fold_layers(graph, plan)
    visible = [op.name for op in graph.nodes() if op.name not in rep]
    folded_into = set(rep.values())
    edges = set()
    for op in graph.nodes():
        for u in op.inputs:
            ru, rv = rep.get(u, u), rep.get(op.name, op.name)
            if (u in rep or op.name in rep) and ru in folded_into and rv in folded_into:
                continue  # inside or between folded layers: the first layer's own edges show it
            if ru != rv:
                edges.add((ru, rv))
    depth = _depths(graph, visible, edges)
    rows: dict[int, list[str]] = {}
    for name in visible:
        rows.setdefault(depth[name], []).append(name)
    pos = {}
    for d, names in rows.items():
        for i, name in enumerate(names):
            pos[name] = (MARGIN + i * (BOX_W + GAP_X), MARGIN + 60 + d * (BOX_H + GAP_Y))
    width = MARGIN * 2 + max(len(n) for n in rows.values()) * (BOX_W + GAP_X)
    height = MARGIN * 2 + 60 + (max(rows) + 1) * (BOX_H + GAP_Y)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{MARGIN}" y="{MARGIN - 10}" font-size="14">{escape(_title(plan))}</text>']
    parts += _legend(plan)
    parts += _frames(graph, plan, pos, kept)
    parts += _edges(plan, edges, pos)
    parts += [_box(graph.node(name), plan, *pos[name]) for name in visible]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _title(plan) -> str:
    return (f"autotp plan on {plan.mesh}, {'training' if plan.training else 'inference'}: "
            f"box colour = output placement per mesh axis ({', '.join(plan.mesh.names)}), red edges run collectives")


def _legend(plan) -> list[str]:
    items = [("R", "replicated"), ("P", "partial sum")] + [(f"S({d})", f"split on dim {d}") for d in range(3)]
    out, x = [], MARGIN
    for placement, label in items:
        out.append(f'<rect x="{x}" y="{MARGIN + 5}" width="14" height="14" fill="{placement_color(placement)}" '
                   f'stroke="#555"/><text x="{x + 18}" y="{MARGIN + 16}">{placement} {label}</text>')
        x += 140
    return out


def _frames(graph, plan, pos, kept) -> list[str]:
    """A dashed frame around each kept layer, labelled with the stack and its count."""
    out = []
    for prefix, (stack, n) in kept.items():
        members = [pos[op.name] for op in graph.nodes() if op.name in pos
                   and (_scope(plan, op) == prefix or _scope(plan, op).startswith(prefix + "."))]
        if not members:
            continue
        x0, y0 = min(x for x, _ in members) - 8, min(y for _, y in members) - 22
        x1, y1 = max(x for x, _ in members) + BOX_W + 8, max(y for _, y in members) + BOX_H + 8
        out.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#333" '
                   f'stroke-dasharray="6,4"/><text x="{x0 + 6}" y="{y0 + 14}" font-size="13" font-weight="bold">'
                   f'{escape(stack)}.* ×{n} (drawn once: {escape(prefix)})</text>')
    return out


def _edges(plan, edges, pos) -> list[str]:
    by_edge = _edge_collectives(plan)
    out = []
    for u, v in sorted(edges):
        x1, y1 = pos[u][0] + BOX_W // 2, pos[u][1] + BOX_H
        x2, y2 = pos[v][0] + BOX_W // 2, pos[v][1]
        colls = by_edge.get((u, v), [])
        if not colls:
            out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#999"/>')
            continue
        forward = [c for c in colls if c["phase"] == "forward"]
        label = ", ".join(f"{c['kind']} {format_bytes(c['bytes'])}" for c in forward) or "backward only"
        tip = "; ".join(f"{c['phase']} {c['kind']} on {c['axis']} {format_bytes(c['bytes'])}" for c in colls)
        out.append(f'<g><title>{escape(tip)}</title><line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#d62728" '
                   f'stroke-width="2.5"/><text x="{(x1 + x2) // 2 + 4}" y="{(y1 + y2) // 2}" fill="#d62728">'
                   f'{escape(label)}</text></g>')
    for c in plan.collectives:  # the outputs' gathers, under their producer
        if c["node"] == "output" and c["phase"] == "forward" and c["producer"] in pos:
            x, y = pos[c["producer"]]
            out.append(f'<text x="{x}" y="{y + BOX_H + 12}" fill="#d62728">→ output: {c["kind"]} '
                       f'{escape(format_bytes(c["bytes"]))}</text>')
    return out


def _box(op, plan, x, y) -> str:
    layout = plan.nodes[op.name].out if op.name in plan.nodes else ()
    stripe = BOX_W / max(len(layout), 1)
    rects = "".join(f'<rect x="{x + i * stripe:.1f}" y="{y}" width="{stripe:.1f}" height="{BOX_H}" '
                    f'fill="{placement_color(p)}"/>' for i, p in enumerate(layout))
    name = op.fqn if op.kind == KIND_PARAM else f"{op.op_name.split('.')[0]}  {_leaf(plan.scopes.get(op.name, ''))}"
    tip = f"{op.name}: {op.op_name} {' '.join(str(m) for m in op.out)} -> {' '.join(layout)}"
    return (f'<g><title>{escape(tip)}</title>{rects}<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" '
            f'fill="none" stroke="#333"/><text x="{x + 4}" y="{y + 14}">{escape(_short(name))}</text>'
            f'<text x="{x + 4}" y="{y + 29}">{escape(" ".join(layout))}</text></g>')


def _leaf(scope: str) -> str:
    return scope.rsplit(".", 1)[-1]


def _short(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]
