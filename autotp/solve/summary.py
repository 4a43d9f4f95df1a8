"""A plan as text: placements, collectives, predicted time and memory, and what fell back."""

from __future__ import annotations

from collections import Counter

from autotp.units import format_bytes


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def format_summary(plan) -> str:
    lines = [f"autotp plan on {plan.mesh} under profile {plan.profile!r} "
             f"({'training' if plan.training else 'inference'})", ""]
    width = max((len(k) for k in plan.parameters), default=10)
    lines.append(f"{'parameter':<{width}}  " + "  ".join(f"{n:>5}" for n in plan.mesh.names))
    for fqn, placements in plan.parameters.items():
        lines.append(f"{fqn:<{width}}  " + "  ".join(f"{p:>5}" for p in placements))
    lines += ["", "collectives:"]
    counts = Counter((c["phase"], c["kind"], c["axis"]) for c in plan.collectives)
    if not counts:
        lines.append("  none")
    for (phase, kind, axis), n in sorted(counts.items()):
        total = sum(c["time_s"] for c in plan.collectives if (c["phase"], c["kind"], c["axis"]) == (phase, kind, axis))
        nbytes = sum(c["bytes"] for c in plan.collectives if (c["phase"], c["kind"], c["axis"]) == (phase, kind, axis))
        lines.append(f"  {phase:<8} {kind:<14} on {axis:<4} x{n:<3} {format_bytes(nbytes):>10}  {_fmt_s(total)}")
    p = plan.predicted
    hidden = f", of which {_fmt_s(p['hidden_comm_s'])} hidden behind backward" if p.get("hidden_comm_s") else ""
    lines += ["", f"predicted step time: {_fmt_s(p['total_s'])} "
                  f"(compute {_fmt_s(p['compute_s'])}, communication {_fmt_s(p['comm_s'])}{hidden})"]
    mem = plan.memory
    lines.append("memory per device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items() if v or k == "total"))
    lines.append(f"ILP: {plan.ilp['ops']} ops in {plan.ilp['groups']} groups, "
                 f"{plan.ilp['variables']} variables, {plan.ilp['constraints']} constraints")
    if plan.fallback_ops:
        lines += ["", f"replicated because no rule covered them ({len(plan.fallback_ops)}):"]
        lines += [f"  {name}: {reason}" for name, reason in plan.fallback_ops.items()]
    else:
        lines += ["", "fallback ops: none (every op had a strategy rule)"]
    return "\n".join(lines)
