"""The plan as a terminal report: parameters, collectives per layer, step time, memory, baselines.

Plain text with aligned columns (no dependency). Identical layers are folded
into one row with a ``×N`` count (`autotp.report.collapse`). Pure functions
of `Plan` objects.
"""

from __future__ import annotations

from autotp.cost.memory import TERMS
from autotp.report.collapse import collapse
from autotp.solve.assemble import calls_per_step
from autotp.units import format_bytes


PHASES = ("forward", "backward", "step")  # "step": after the optimizer step (ZeRO-1's parameter all-gathers)


def format_seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def align(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns padded to their widest cell; the first ``left`` columns flush left, the rest flush right."""
    cells = [header] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _count(n: int) -> str:
    return f"×{n}" if n > 1 else ""


def parameter_lines(plan) -> list[str]:
    """A parameter's layout per mesh axis; a column for the axes its optimizer state is split on, if any is."""
    sharded, gradients = plan.optimizer_sharding, set(plan.gradient_sharding)

    def extra(fqn: str) -> tuple:
        """``("dp",)``, ``("dp +grad",)`` with the gradient split too (ZeRO-2), ``("-",)``; nothing without a column."""
        if not sharded:
            return ()
        return (("+".join(sharded.get(fqn, ())) or "-") + (" +grad" if fqn in gradients else ""),)

    rows = collapse([(fqn, tuple(layout) + extra(fqn)) for fqn, layout in plan.parameters.items()])
    header = ["parameter", *plan.mesh.names] + (["optimizer split on"] if sharded else [])
    return align(header + [""], [[r.name, *r.values, _count(r.count)] for r in rows])


def _scope(plan, c: dict) -> str:
    if c["node"] == "output":
        return "output"
    return plan.scopes.get(c["node"]) or c["node"]


def collective_lines(plan) -> list[str]:
    """One row per collective kind at one place of a layer: forward, backward, then after the optimizer step."""
    items = [(_scope(plan, c), (c["phase"], c["kind"], c["axis"], format_bytes(c["bytes"]), format_seconds(c["time_s"])))
             for phase in PHASES for c in plan.collectives if c["phase"] == phase]
    if not items:
        return ["  none"]
    rows = collapse(items)
    total = lambda phase: sum(c["time_s"] * calls_per_step(c, plan.micro_batches)  # noqa: E731
                              for c in plan.collectives if c["phase"] == phase)
    lines = align(["where", "phase", "collective", "axis", "bytes", "time each", ""],
                  [[r.name, *r.values, _count(r.count)] for r in rows], left=4)
    step = f", after the optimizer step {format_seconds(total('step'))}" if total("step") else ""
    per = f" a step of {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else ""
    return lines + [f"total{per}: forward {format_seconds(total('forward'))}, backward "
                    f"{format_seconds(total('backward'))}" + step]


def exposed_comm_s(plan) -> float:
    """Communication the step waits for: the step time less compute (hidden gradient sums already taken off)."""
    return max(plan.predicted["total_s"] - plan.predicted["compute_s"], 0.0)


def time_line(plan) -> str:
    p = plan.predicted
    gathers, matmuls = p.get("gather_hidden_s", 0.0), p.get("overlap_hidden_s", 0.0)
    sums = p["comm_s"] - exposed_comm_s(plan) - gathers - matmuls
    parts = [f"{format_seconds(s)} of {what} hidden behind {where}" for s, what, where in (
        (sums, "gradient sums", "the backward pass"), (gathers, "ZeRO all-gathers", "the next forward pass"),
        (matmuls, "tensor-parallel collectives", "their matmuls")) if s > 1e-12]
    hidden = f", of which {' and '.join(parts)}" if parts else ""
    return (f"predicted step time: {format_seconds(p['total_s'])} (compute {format_seconds(p['compute_s'])}, "
            f"communication {format_seconds(p['comm_s'])}{hidden})")


def memory_line(plan) -> str:
    mem = plan.memory
    return "memory per device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items() if v or k == "total")


def recompute_lines(plan) -> list[str]:
    """The layers recomputed in backward, identical ones folded: ``blocks.* ×2``."""
    if not plan.recompute:
        return []
    rows = collapse([(layer, ()) for layer in plan.recompute])
    layers = ", ".join(r.name + (f" {_count(r.count)}" if r.count > 1 else "") for r in rows)
    return [f"recomputed in backward: {layers} (forward compute {format_seconds(plan.predicted['recompute_s'])})"]


def regather_lines(plan) -> list[str]:
    """The kinds of all-gathered inputs kept as shards and gathered again in backward (`autotp.solve.regather`)."""
    if not plan.regather:
        return []
    return [f"gathered again in backward: all-gathered {' and '.join(plan.regather)} kept as shards "
            f"({format_seconds(plan.predicted.get('regather_s', 0.0))} of all-gathers)"]


def fallback_lines(plan) -> list[str]:
    if not plan.fallback_ops:
        return ["fallback ops: none (every op had a strategy rule)"]
    by_reason: dict[str, list[str]] = {}
    for name, reason in plan.fallback_ops.items():
        by_reason.setdefault(reason, []).append(name)
    lines = [f"replicated because no rule covered them ({len(plan.fallback_ops)}):"]
    for reason, names in by_reason.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        lines.append(f"  {', '.join(names[:3])}{more}: {reason}")
    return lines


def comparison_lines(plan, baselines) -> list[str]:
    """The plan and each baseline side by side: step time split, and memory per device by term."""
    columns = [("autotp", plan)] + [(b.name, b.plan) for b in baselines]
    rows = []

    def row(label, value):
        rows.append([label] + [value(p) if p is not None else "n/a" for _, p in columns])

    row("step time", lambda p: format_seconds(p.predicted["total_s"]))
    row("  compute", lambda p: format_seconds(p.predicted["compute_s"]))
    row("  communication", lambda p: format_seconds(exposed_comm_s(p)))
    for term in ("total",) + TERMS:
        if any(p is not None and p.memory.get(term) for _, p in columns):
            row("memory " + term if term == "total" else "  " + term, lambda p, t=term: format_bytes(p.memory[t]))
    if plan.predicted["total_s"] > 0:
        row("step time ÷ autotp's", lambda p: f"{p.predicted['total_s'] / plan.predicted['total_s']:.2f}x")
    lines = align(["", *(name for name, _ in columns)], rows)
    lines += [f"  {b.name}: n/a because {b.reason}" for b in baselines if b.plan is None]
    return lines


def step_terms(plan) -> dict[str, float]:
    """A plan's step time by where it goes: compute, collectives on the critical path (less what their matmuls hide),
    overlapped ones not hidden."""
    p = plan.predicted
    gradient, gather = p.get("gradient_s", 0.0), p.get("gather_s", 0.0)
    return {"compute": p["compute_s"], "collectives": p["comm_s"] - gradient - gather - p.get("overlap_hidden_s", 0.0),
            "gradient sums not hidden": gradient - p.get("gradient_hidden_s", 0.0),
            "ZeRO all-gathers not hidden": gather - p.get("gather_hidden_s", 0.0)}


def verdict_lines(plan, baselines) -> list[str]:
    """How far the plan is from the best baseline, and which terms of the step make the difference."""
    ready = [b for b in baselines if b.plan is not None]
    if not ready:
        return []
    best = min(ready, key=lambda b: b.plan.predicted["total_s"])
    mine, theirs = plan.predicted["total_s"], best.plan.predicted["total_s"]
    ratio = mine / theirs if theirs > 0 else 1.0
    deltas = {term: value - step_terms(best.plan)[term] for term, value in step_terms(plan).items()}
    why = ", ".join(f"{term} {'+' if d > 0 else '-'}{format_seconds(abs(d))}" for term, d in
                    sorted(deltas.items(), key=lambda kv: -abs(kv[1])) if abs(d) > 1e-12 * max(theirs, 1e-12))
    head = (f"autotp: {format_seconds(mine)}, {ratio:.3f}x the best baseline ({best.name}, {format_seconds(theirs)})"
            + (f": {why}" if why else ": the same plan's cost"))
    lines = [head]
    if ratio > 1 + 1e-9:
        stats = plan.stats or {}
        if stats.get("constrained"):
            lines.append("  this plan was made under pins or a filter, which the baseline is not: it is outside "
                         "this plan's search space")
        elif stats.get("gap"):
            lines.append(f"  the solver stopped at its time limit {stats['gap']:.1%} from the optimum: raise "
                         "time_limit_s for a plan at least as fast as every baseline")
        else:
            lines.append("  slower than a plan of its own search space: this is a bug, please report it")
    return lines


def format_plan(plan, baselines=None) -> str:
    """The whole report; ``baselines`` (from `autotp.report.baselines`) adds the side-by-side comparison."""
    lines = [f"autotp plan on {plan.mesh} under profile {plan.profile!r} "
             f"({'training' if plan.training else 'inference'})", ""]
    lines += parameter_lines(plan)
    lines += ["", "collectives (per layer where layers are identical; 'time each' is one call):"]
    lines += collective_lines(plan)
    lines += ["", time_line(plan), memory_line(plan)] + recompute_lines(plan) + regather_lines(plan)
    lines.append(f"ILP: {plan.ilp['ops']} ops in {plan.ilp['groups']} groups, "
                 f"{plan.ilp['variables']} variables, {plan.ilp['constraints']} constraints")
    if baselines:
        lines += ["", "against the baselines (same cost model, same pipeline):"]
        lines += comparison_lines(plan, baselines)
        lines += [""] + verdict_lines(plan, baselines)
    lines += [""] + fallback_lines(plan)
    return "\n".join(lines)
