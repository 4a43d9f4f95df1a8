"""The working set of an inference program: the most that one op holds at once, which the memory peak adds.

Without autograd a forward pass keeps nothing between ops but the program's
state (parameters, and buffers such as a key/value cache) and tensors on
their way to their next use. Its peak is therefore the state plus the
largest working set of one op: the op's inputs and outputs on local shapes
(`autotp.cost.memory.working_bytes`). A prefill's attention reads queries,
keys and values and the mask over the whole cache at once: at Llama-2-70B's
batch of 64 prompts of 2048 tokens that is GiBs a device, which a memory
limit that counted the weights and the cache alone would pass.

A plan's working set is the largest over its groups (`working_sets`: per
group, per choice, the largest among the group's ops). The ILP holds it as
one continuous column at least each group's (`autotp.solve.ilp`): linear,
exact at the optimum, and added to the memory row that the limit bounds.
Training programs peak otherwise (the saved activations,
`autotp.solve.step.memory_bytes`) and have no working-set term.
"""

from __future__ import annotations

from autotp.cost.memory import working_bytes
from autotp.graph.flops import is_alias
from autotp.graph.opgraph import KIND_BUFFER, KIND_OP, KIND_PARAM


def working_sets(graph, problem, mesh) -> dict[str, list[int]]:
    """Per group that may hold the peak, its largest working set per choice.

    Twins of shared layers are alike, so each distinct op is measured once.
    A group whose largest working set is below some group's smallest never
    holds the peak, and is left out.
    """
    state = _state_and_its_views(graph)
    sets = {}
    for leader, group in problem.groups.items():
        members = {problem.sharing.of(m) for m in group.choices}
        values = [0] * group.n
        for member in members:
            op = graph.node(member)
            if op.kind != KIND_OP:
                continue
            for c in range(group.n):
                values[c] = max(values[c], working_bytes(op, problem.strategy(member, c), mesh, state))
        if any(values):
            sets[leader] = values
    if not sets:
        return {}
    floor_group = max(sets, key=lambda g: min(sets[g]))
    floor = min(sets[floor_group])
    return {g: v for g, v in sets.items() if g == floor_group or max(v) > floor}


def _state_and_its_views(graph) -> frozenset:
    """Parameters, buffers, and views of them (a weight's transpose): storage the state already counts."""
    state = set()
    for op in graph.nodes():  # in program order: a view's input comes before it
        if op.kind in (KIND_PARAM, KIND_BUFFER) or (op.kind == KIND_OP and is_alias(op.target) and op.inputs
                                                    and op.inputs[0] in state):
            state.add(op.name)
    return frozenset(state)


def working_peak_bytes(problem, choice: dict[str, int]) -> int:
    """The largest working set of ``choice`` (group -> choice index): what an inference program adds to its state
    at its peak; 0 for a training program."""
    return max((values[choice[g]] for g, values in problem.working.items()), default=0)
