"""A bar chart of the plan against the baselines: step time (compute + communication) and memory per device.

Two panels, one bar per plan. Step time is stacked compute then exposed
communication; memory is stacked by term (parameters, gradients, optimizer,
activations, buffers). A baseline without a plan is marked "n/a". Pure: a
`Plan` and `Baseline` list in, SVG text out (rectangles and text: no plotting
library, nothing to rasterise).
"""

from __future__ import annotations

from html import escape

from autotp.cost.memory import TERMS
from autotp.report.table import exposed_comm_s

INK, GRID = "#1e1e1e", "#e1e1e1"
TIME_COLORS = {"compute": "#4678be", "communication": "#eb8c32"}
MEMORY_COLORS = {"parameters": "#4678be", "gradients": "#78aae1", "optimizer": "#966ebe",
                 "buffers": "#a0a0a0", "activations": "#5aaa64"}
PANEL_W, PANEL_H, TOP, BOTTOM, LEFT = 640, 400, 70, 100, 90
FONT_PX, CHAR_PX = 14, 8.4  # monospace text: every character as wide, so labels can be centred


class Canvas:
    """An SVG drawing of rectangles and one-line monospace labels, in pixels from the top left."""

    def __init__(self, width: int, height: int):
        self.width, self.height, self.items = width, height, []

    def rect(self, x: int, y: int, w: int, h: int, color: str) -> None:
        if w > 0 and h > 0:
            self.items.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{color}"/>')

    def text(self, x: float, y: float, text: str, color: str = INK) -> None:
        """``text`` whose box's top-left corner is ``(x, y)``."""
        self.items.append(f'<text x="{x:.1f}" y="{y + FONT_PX:.1f}" fill="{color}">{escape(text)}</text>')

    @staticmethod
    def text_width(text: str) -> float:
        return len(text) * CHAR_PX

    def svg(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'font-family="monospace" font-size="{FONT_PX}">\n<rect width="100%" height="100%" fill="white"/>\n'
                + "\n".join(self.items) + "\n</svg>\n")


def _time_parts(plan) -> dict[str, float]:
    return {"compute": plan.predicted["compute_s"] * 1e3, "communication": exposed_comm_s(plan) * 1e3}


def _memory_parts(plan) -> dict[str, float]:
    return {t: plan.memory.get(t, 0) / 2 ** 30 for t in TERMS}


def _number(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def _label_lines(name: str) -> list[str]:
    """``data-parallel`` -> ``["data-", "parallel"]``: names longer than a bar slot break after a dash."""
    if len(name) <= 10 or "-" not in name:
        return [name[:12]]
    head, tail = name.split("-", 1)
    return [head + "-", tail[:12]]


def _panel(canvas, x0, title, unit, columns, parts_of, colors) -> None:
    """One panel: title, axis with three ticks, a stacked bar per column, the total above each bar."""
    canvas.text(x0 + LEFT, 20, f"{title} ({unit})")
    top = max((sum(parts_of(p).values()) for _, p in columns if p is not None), default=1.0) or 1.0
    plot_h, base = PANEL_H - TOP - BOTTOM, PANEL_H - BOTTOM
    for frac in (0.0, 0.5, 1.0):
        y = base - int(frac * plot_h)
        canvas.rect(x0 + LEFT, y, PANEL_W - LEFT - 20, 1, GRID)
        label = _number(top * frac)
        canvas.text(x0 + LEFT - 8 - Canvas.text_width(label), y - 7, label)
    slot = (PANEL_W - LEFT - 20) // max(len(columns), 1)
    for i, (name, plan) in enumerate(columns):
        x = x0 + LEFT + i * slot + slot // 5
        width = slot * 3 // 5
        for line, label in enumerate(_label_lines(name)):
            canvas.text(x + (width - Canvas.text_width(label)) // 2, base + 12 + 18 * line, label)
        if plan is None:
            canvas.text(x + (width - Canvas.text_width("n/a")) // 2, base - 24, "n/a")
            continue
        y, parts = base, parts_of(plan)
        for part, value in parts.items():
            h = int(round(value / top * plot_h))
            canvas.rect(x, y - h, width, h, colors[part])
            y -= h
        total = _number(sum(parts.values()))
        canvas.text(x + (width - Canvas.text_width(total)) // 2, y - 20, total)
    _legend(canvas, x0 + LEFT, x0 + PANEL_W - 10, PANEL_H - 46,
            [(k, c) for k, c in colors.items() if any(p is not None and parts_of(p).get(k) for _, p in columns)])


def _legend(canvas, x_start, x_end, y, items) -> None:
    """Coloured squares and names, wrapped onto a second row when the panel is too narrow."""
    x = x_start
    for name, color in items:
        width = 16 + Canvas.text_width(name) + 18
        if x + width > x_end:
            x, y = x_start, y + 22
        canvas.rect(x, y, 12, 12, color)
        canvas.text(x + 16, y, name)
        x += width


def baseline_chart(plan, baselines) -> str:
    """An SVG: the plan and each baseline, step time on the left, memory per device on the right."""
    columns = [("autotp", plan)] + [(b.name, b.plan) for b in baselines]
    canvas = Canvas(2 * PANEL_W, PANEL_H)
    _panel(canvas, 0, "step time", "ms", columns, _time_parts, TIME_COLORS)
    _panel(canvas, PANEL_W, "memory per device", "GiB", columns, _memory_parts, MEMORY_COLORS)
    return canvas.svg()
