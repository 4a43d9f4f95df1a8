"""Turn a solved problem into a `Plan`: chosen strategies, the collectives they imply, costs, memory.

The predicted step time is `autotp.solve.step.step_time` of the chosen
choices: the ILP's own objective. The list of collectives is the same model
seen per collective (one record per distinct redistribution of a tensor, as
the lowering shares them), so compute plus every record and the all-gathers
backward runs again (``regather_s``, `autotp.solve.regather`), less what the
passes hide (``hidden_s``: gradient sums behind the backward pass, ZeRO's
all-gathers behind the next forward), is that step time again.
"""

from __future__ import annotations

from autotp.cost.comm import (collective_time_s, gradient_slice_time_s, inner_collective_calls, optimizer_gather,
                              optimizer_time_s)
from autotp.cost.compute import compute_time_s
from autotp.cost.memory import kept_use_bytes, memory_by_term
from autotp.cost.reshard import cheapest_steps, step_seconds
from autotp.graph.opgraph import KIND_BUFFER, KIND_INPUT, KIND_PARAM
from autotp.placement import R, layout_str, local_bytes
from autotp.redistribute import entry_layout, gathers, plan_steps
from autotp.solve.plan import NodePlan, Plan
from autotp.solve.problem import (OUTPUT, deferred_parameters, output_layout, split_gradient_axes, use_target,
                                  uses_of)
from autotp.solve.recompute import recompute_effect, recomputed_layers
from autotp.solve.step import matmul_hidden_s, regather_effect, step_time
from autotp.solve.working import working_peak_bytes


def chosen_strategies(problem, solution) -> dict:
    return {node: problem.strategy(node, solution.choice[group]) for node, group in problem.group_of.items()}


def _record(mesh, node, producer, index, phase, kind, step, seconds) -> dict:
    """One collective; a flat one over several axes is named by them joined: ``dp+tp``."""
    span = step.span
    record = {"node": node, "input": index, "producer": producer, "phase": phase, "kind": kind,
              "axis": "+".join(mesh.names[a] for a in span) if len(span) > 1 else mesh.names[step.axis],
              "bytes": int(step.message_bytes), "time_s": _round(seconds)}
    if step.form:  # a multi-axis sum in hierarchical or flat form: the lowering replays the same choice
        record["form"] = step.form
    return record


def edge_collectives(mesh, profile, training, node, producer, index, src, dst, meta, grad, grad_axes,
                     deferred: bool = False, bucket_bytes: int = 0) -> list[dict]:
    """Every collective one redistribution runs, forward and (when training) backward, in execution order.

    A ``deferred`` gradient sum (a parameter's only use, bucketed behind the
    backward pass) is recorded at the bucket's rates, marked ``"bucketed"``.
    """
    grad = training and grad
    options = dict(deferred=deferred, bucket_bytes=bucket_bytes) if deferred else {}
    every = cheapest_steps(src, dst, meta, mesh, profile, grad, grad_axes, **options)
    forward, backward, bucketed = step_seconds(every, mesh, profile, grad, **options)
    real = [i for i, s in enumerate(every) if mesh.shape[s.axis] > 1]
    out = [_record(mesh, node, producer, index, "forward", every[i].forward_kind, every[i], forward[i])
           for i in real if every[i].forward_kind]
    out += [_record(mesh, node, producer, index, "backward", every[i].backward_kind, every[i], backward[i])
            | ({"bucketed": True} if bucketed else {}) for i in reversed(real) if grad and every[i].backward_kind]
    return out


def inner_collectives(op, strategy, mesh, profile, training: bool) -> list[dict]:
    """The collectives a strategy's own implementation runs (vocabulary-parallel loss, expert parallelism)."""
    return [{"node": op.name, "input": 0, "producer": op.name, "phase": phase, "kind": kind,
             "axis": mesh.names[axis], "bytes": int(nbytes),
             "time_s": _round(collective_time_s(kind, axis, nbytes, mesh, profile))}
            for kind, axis, nbytes, phase in inner_collective_calls(op, strategy, mesh, training)]


def optimizer_collectives(op, strategy, mesh, profile) -> list[dict]:
    """The all-gather that rebuilds a parameter whose optimizer state is split (ZeRO-1), after the step."""
    gather = optimizer_gather(op, strategy, mesh)
    if gather is None:
        return []
    axes, nbytes = gather
    return [{"node": op.name, "input": 0, "producer": op.name, "phase": "step", "kind": "all_gather",
             "axis": "+".join(mesh.names[a] for a in axes), "bytes": int(nbytes),
             "time_s": _round(optimizer_time_s(op, strategy, mesh, profile))}]


def distinct_uses(graph, chosen, mesh, training, whole_outputs=False):
    """Per distinct redistribution of a tensor (as the lowering shares them): ``(producer, uses, meta, dst, grad,
    summed, split)``, ``uses`` the ``(consumer, input)`` pairs that share it, in program order.

    ``split`` is the producer's ZeRO-2 axes, ``summed`` the axes its gradient is still all-reduced over.
    """
    for producer, uses in uses_of(graph).items():
        shared: dict[tuple, list] = {}
        for consumer, i in uses:
            strategy = None if consumer == OUTPUT else chosen[consumer]
            meta, dst, grad, axes = use_target(graph, mesh, training, whole_outputs, producer, consumer, i,
                                               chosen[producer].out, strategy)
            shared.setdefault((dst, grad, axes), [meta]).append((consumer, i))
        made = chosen[producer]
        split = made.gradient_slice_axes
        for (dst, grad, axes), (meta, *sharing) in shared.items():
            yield producer, sharing, meta, dst, grad, split_gradient_axes(split, made.out, dst, grad, axes), split


def all_collectives(graph, chosen, mesh, profile, training, whole_outputs=False, deferred=frozenset(),
                    bucket_bytes: int = 0) -> list[dict]:
    """The collectives of the lowered program; uses of one tensor in one layout share them."""
    out = []
    for op in graph.nodes():
        out += inner_collectives(op, chosen[op.name], mesh, profile, training)
        out += optimizer_collectives(op, chosen[op.name], mesh, profile)
    for producer, uses, meta, dst, grad, summed, split in distinct_uses(graph, chosen, mesh, training, whole_outputs):
        consumer, i = uses[0]
        node, index = ("output", 0) if consumer == OUTPUT else (consumer, i)
        src = chosen[producer].out
        records = edge_collectives(mesh, profile, training, node, producer, index, src, dst, meta, grad, summed,
                                   producer in deferred, bucket_bytes)
        out += [{**r, "each_micro_batch": True} if split and r.get("bucketed") else r for r in records]
        if split:
            out.append(gradient_slice_collective(mesh, profile, node, producer, index, src, meta, split,
                                                 bucket_bytes))
    return out


def kept_gathered_bytes(graph, chosen, mesh, training, whole_outputs=False, recomputable=frozenset()) -> int:
    """Bytes that redistributions leave alive until backward (`autotp.cost.memory.kept_use_bytes`: sums' results,
    all-gathered inputs a backward or a checkpoint of the ``recomputable`` layers reads): one buffer per distinct
    redistribution, kept if any use keeps it."""
    kept = 0
    for producer, uses, meta, dst, grad, summed, split in distinct_uses(graph, chosen, mesh, training, whole_outputs):
        src = chosen[producer].out
        gathered = gathers(plan_steps(src, dst, meta, mesh.shape), mesh.shape)
        kept += max(kept_use_bytes(graph.node(producer), None if c == OUTPUT else graph.node(c), i, src, dst, meta,
                                   mesh, training, gathered, recomputable) for c, i in uses)
    return kept


def gradient_slice_collective(mesh, profile, node, producer, index, layout, meta, split, bucket_bytes) -> dict:
    """ZeRO-2's reduce-scatter of a parameter's whole gradient into its optimizer slices, in the reducer's buckets."""
    nbytes = local_bytes(meta, layout, mesh.shape)
    return {"node": node, "input": index, "producer": producer, "phase": "backward", "kind": "reduce_scatter",
            "axis": "+".join(mesh.names[a] for a in split), "bytes": int(nbytes),
            "time_s": _round(gradient_slice_time_s(split, nbytes, mesh, profile, bucket_bytes)), "bucketed": True,
            "slice": True, "each_micro_batch": True}


def io_layouts(graph, chosen, mesh, whole_outputs: bool) -> dict:
    """How each rank may take its inputs and gives back its outputs.

    An input may be given whole or as this rank's slice of the ``inputs``
    layout (the most any use can cut it to for free: with a batch split, each
    data-parallel rank's own rows, as with ``DistributedSampler``). Outputs
    come back in the ``outputs`` layouts.
    """
    uses = uses_of(graph)
    inputs = []  # [placeholder, layout] in the order of the tensors among the inputs' pytree leaves
    for op in graph.nodes():
        if op.kind == KIND_INPUT:
            targets = [use_target(graph, mesh, True, whole_outputs, op.name, c, i, chosen[op.name].out,
                                  None if c == OUTPUT else chosen[c])[1] for c, i in uses[op.name]]
            inputs.append([op.name, layout_str(entry_layout(chosen[op.name].out, targets, op.out[0], mesh.shape))])
    outputs = [layout_str(output_layout(chosen[name].out, graph.node(name).out[0], whole_outputs))
               for name in graph.outputs]
    return {"inputs": inputs, "outputs": outputs}


def calls_per_step(record: dict, micro_batches: int) -> int:
    """How often a collective runs in a step: once per micro-batch, but gradient sums in buckets and ZeRO-1's
    all-gathers after the optimizer step run once, except the sums of gradients ZeRO-2 slices (``each_micro_batch``:
    reduce-scattered after every micro-batch, `autotp.lower.reducer`)."""
    once = record["phase"] == "step" or (record.get("bucketed") and not record.get("each_micro_batch"))
    return 1 if once else micro_batches


def plan_memory(graph, problem, solution, chosen, mesh, training, whole_outputs: bool = False) -> dict[str, int]:
    """Memory per device by term, and its peak (``total``: `autotp.solve.step.memory_bytes`); recomputed layers
    keep fewer activations, and rebuild one layer's at a time; all-gathered inputs kept for backward count as
    activations, less what regathering them frees."""
    terms = memory_by_term(graph, chosen, mesh, training, problem.precision)
    _, freed, transient = recompute_effect(problem, solution.choice, solution.recompute)
    freed += regather_effect(problem, solution.choice, solution.regather)[1]
    extra = kept_gathered_bytes(graph, chosen, mesh, training, whole_outputs, problem.recomputable) + transient - freed
    extra += working_peak_bytes(problem, solution.choice)  # inference: the largest working set of one op
    terms["activations"] += extra
    terms["total"] += extra
    if problem.peak_in_backward:  # the larger of backward's start and end, not every term at once
        terms["total"] = max(terms["total"] - terms["gradients"], terms["total"] - terms["activations"])
    return terms


def assemble_plan(graph, problem, solution, mesh, profile, training, inputs: dict, whole_outputs: bool = False) -> Plan:
    chosen = chosen_strategies(problem, solution)
    deferred = deferred_parameters(graph, uses_of(graph)) if problem.overlap_gradients else set()
    collectives = all_collectives(graph, chosen, mesh, profile, training, whole_outputs, deferred,
                                  problem.bucket_bytes)
    step, k = step_time(problem, solution.choice, solution.recompute, solution.regather), problem.micro_batches
    again_s = recompute_effect(problem, solution.choice, solution.recompute)[0]
    regather_s = regather_effect(problem, solution.choice, solution.regather)[0]
    overlap_s = matmul_hidden_s(problem, solution.choice)
    nodes = {op.name: NodePlan(op.op_name, layout_str(chosen[op.name].out),
                               tuple(layout_str(layout) for layout in chosen[op.name].ins), chosen[op.name].impl)
             for op in graph.nodes()}
    params = {op.fqn: layout_str(chosen[op.name].out) for op in graph.nodes() if op.kind == KIND_PARAM}
    optimizer = {op.fqn: [mesh.names[a] for a in chosen[op.name].optimizer_axes]
                 for op in graph.nodes() if op.kind == KIND_PARAM and chosen[op.name].optimizer_axes}
    gradients = [op.fqn for op in graph.nodes() if op.kind == KIND_PARAM and chosen[op.name].gradient_split]
    buffers = {op.fqn: layout_str(chosen[op.name].out) for op in graph.nodes()
               if op.kind == KIND_BUFFER and not all(p == R for p in chosen[op.name].out)}
    return Plan(
        mesh=mesh, profile=profile.name, training=training, parameters=params, nodes=nodes,
        fallback_ops=dict(problem.strategies.fallback), collectives=collectives,
        predicted={"compute_s": again_s + k * sum(compute_time_s(op, chosen[op.name], mesh, profile, training)
                                                  for op in graph.nodes()),
                   "recompute_s": again_s,
                   "comm_s": regather_s + sum(c["time_s"] * calls_per_step(c, k) for c in collectives),
                   "regather_s": regather_s,
                   "gradient_s": step.gradient_s, "gradient_hidden_s": step.gradient_hidden_s,
                   "gather_s": step.gather_s, "gather_hidden_s": step.gather_hidden_s,
                   "overlap_hidden_s": overlap_s,
                   "hidden_s": step.gradient_hidden_s + step.gather_hidden_s + overlap_s,
                   "total_s": step.total_s, "objective_s": solution.objective_s},
        memory=plan_memory(graph, problem, solution, chosen, mesh, training, whole_outputs),
        inputs=inputs,
        ilp={"groups": len(problem.groups), "edges": len(problem.edges), "fanouts": len(problem.fanouts),
             "variables": solution.variables, "constraints": solution.constraints, "ops": len(graph),
             **problem.sharing.summary()},
        runtime={"overlap_gradients": problem.overlap_gradients, "bucket_bytes": problem.bucket_bytes,
                 "whole_outputs": whole_outputs, "precision": problem.precision,
                 "overlap_tp": problem.overlap_tp},
        optimizer_sharding=optimizer,
        gradient_sharding=gradients,
        recompute=recomputed_layers(problem, solution.recompute),
        regather=list(solution.regather),
        micro_batches=k,
        io=io_layouts(graph, chosen, mesh, whole_outputs),
        buffers=buffers,
    )


def _round(x: float) -> float:
    return float(f"{x:.12g}")
