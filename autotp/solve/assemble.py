"""Turn a solved problem into a `Plan`: chosen strategies, the collectives they imply, costs, memory."""

from __future__ import annotations

from autotp.cost.comm import collective_time_s, inner_all_reduces, span_time_s
from autotp.cost.compute import backward_time_s, compute_time_s
from autotp.cost.memory import memory_by_term
from autotp.cost.overlap import collective_savings_s
from autotp.cost.reshard import cheapest_steps
from autotp.graph.opgraph import KIND_PARAM
from autotp.placement import R, layout_str
from autotp.solve.plan import NodePlan, Plan, _round


def chosen_strategies(problem, solution) -> dict:
    return {node: problem.strategy(node, solution.choice[group]) for node, group in problem.group_of.items()}


def _record(mesh, profile, node, producer, index, phase, kind, axis, nbytes, form="", span=()) -> dict:
    """One collective; a flat one over several axes (``span``) is named by them joined: ``dp+tp``."""
    seconds = (span_time_s(kind, span, nbytes, mesh, profile) if len(span) > 1
               else collective_time_s(kind, axis, nbytes, mesh, profile))
    record = {"node": node, "input": index, "producer": producer, "phase": phase, "kind": kind,
              "axis": "+".join(mesh.names[a] for a in span) if len(span) > 1 else mesh.names[axis],
              "bytes": int(nbytes), "time_s": _round(seconds)}
    if form:  # a multi-axis sum in hierarchical or flat form: the lowering replays the same choice
        record["form"] = form
    return record


def edge_collectives(mesh, profile, training, node, producer, index, src, dst, meta, grad, grad_axes) -> list[dict]:
    """Every collective one edge runs, forward and (when training) backward, in execution order."""
    grad = training and grad
    steps = [s for s in cheapest_steps(src, dst, meta, mesh, profile, grad, grad_axes) if mesh.shape[s.axis] > 1]
    out = [_record(mesh, profile, node, producer, index, "forward", s.forward_kind, s.axis, s.message_bytes, s.form,
                   s.span) for s in steps if s.forward_kind]
    if grad:
        out += [_record(mesh, profile, node, producer, index, "backward", s.backward_kind, s.axis, s.message_bytes,
                        s.form, s.span) for s in reversed(steps) if s.backward_kind]
    return out


def inner_collectives(op, strategy, mesh, profile) -> list[dict]:
    """The all-reduces a strategy's own implementation runs (vocabulary-parallel loss)."""
    return [_record(mesh, profile, op.name, op.name, 0, "forward", "all_reduce", axis, nbytes)
            for axis, nbytes in inner_all_reduces(op, strategy, mesh)]


def all_collectives(graph, chosen, mesh, profile, training) -> list[dict]:
    """The collectives of the lowered program; consumers of one tensor in one layout share them."""
    out, seen = [], set()
    for op in graph.nodes():
        s = chosen[op.name]
        out += inner_collectives(op, s, mesh, profile)
        for i, producer in enumerate(op.inputs):
            meta = op.in_metas[i]
            grad = op.requires_grad and graph.node(producer).requires_grad and meta.is_float
            axes = tuple(a for a in s.grad_allreduce_axes(i) if mesh.shape[a] > 1)
            key = (producer, chosen[producer].out, s.ins[i], axes if grad else ())
            if key in seen:
                continue
            seen.add(key)
            out += edge_collectives(mesh, profile, training, op.name, producer, i, chosen[producer].out,
                                    s.ins[i], meta, grad, axes)
    r = (R,) * mesh.ndim
    for name in graph.outputs:
        op = graph.node(name)
        for meta in op.out:
            out += edge_collectives(mesh, profile, training, "output", name, 0, chosen[name].out, r, meta,
                                    op.requires_grad and meta.is_float, ())
    return out


def runtime_savings_s(graph, chosen, collectives, mesh, profile, training, gradients_hidden) -> tuple[float, float]:
    """Seconds `parallelize`'s default batching and overlap take off the collectives (autotp/cost/overlap.py)."""
    ops = graph.nodes()
    position = {op.name: i for i, op in enumerate(ops)} | {"output": len(ops)}
    backward = [backward_time_s(op, chosen[op.name], mesh, profile, training) for op in ops]
    forward = [compute_time_s(op, chosen[op.name], mesh, profile, training) - b for op, b in zip(ops, backward)]
    latency = {name: profile.link(link).latency_s for name, link in zip(mesh.names, mesh.links)}
    latency |= {c["axis"]: max(latency[n] for n in c["axis"].split("+")) for c in collectives if "+" in c["axis"]}
    # a hierarchical gradient sum runs as one CollectiveChain, which the lowering neither batches nor overlaps
    collectives = [c for c in collectives if not c.get("form", "").startswith("grad hierarchical")]

    def hidden_already(c) -> bool:  # counted in hidden_comm_s by overlap_gradients
        return gradients_hidden and c["phase"] == "backward" and graph.node(c["producer"]).kind == KIND_PARAM

    return collective_savings_s(collectives, position, forward, backward, latency, hidden_already)


def assemble_plan(graph, problem, solution, mesh, profile, training, inputs: dict) -> Plan:
    chosen = chosen_strategies(problem, solution)
    collectives = all_collectives(graph, chosen, mesh, profile, training)
    compute_s = sum(compute_time_s(op, chosen[op.name], mesh, profile, training) for op in graph.nodes())
    comm_s = sum(c["time_s"] for c in collectives)
    hidden_s = 0.0
    if problem.overlap_gradients:  # parameter-gradient reductions hide behind the backward compute
        backward_s = sum(backward_time_s(op, chosen[op.name], mesh, profile, training) for op in graph.nodes())
        reductions_s = sum(c["time_s"] for c in collectives if c["phase"] == "backward"
                           and (c["kind"] == "all_reduce" or c.get("form", "").startswith("grad "))
                           and graph.node(c["producer"]).kind == KIND_PARAM)
        hidden_s = min(reductions_s, backward_s)
    batched_s, overlapped_s = runtime_savings_s(graph, chosen, collectives, mesh, profile, training,
                                                problem.overlap_gradients)
    nodes = {op.name: NodePlan(op.op_name, layout_str(chosen[op.name].out),
                               tuple(layout_str(layout) for layout in chosen[op.name].ins), chosen[op.name].impl)
             for op in graph.nodes()}
    params = {op.fqn: layout_str(chosen[op.name].out) for op in graph.nodes() if op.kind == KIND_PARAM}
    fallback = {name: reason for name, reason in problem.strategies.fallback.items()}
    return Plan(
        mesh=mesh, profile=profile.name, training=training, parameters=params, nodes=nodes,
        fallback_ops=fallback, collectives=collectives,
        predicted={"compute_s": compute_s, "comm_s": comm_s, "hidden_comm_s": hidden_s,
                   "batching_saved_s": batched_s, "overlap_hidden_s": overlapped_s,
                   "total_s": compute_s + comm_s - hidden_s - batched_s - overlapped_s,
                   "objective_s": solution.objective_s},
        memory=memory_by_term(graph, chosen, mesh, training),
        inputs=inputs,
        ilp={"groups": len(problem.groups), "edges": len(problem.edges), "variables": solution.variables,
             "constraints": solution.constraints, "ops": len(graph), **problem.sharing.summary()},
    )
