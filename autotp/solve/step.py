"""The step time of one choice per group: the function the ILP minimises, evaluated directly.

The ILP (`autotp.solve.ilp`) and the plan's report (`autotp.solve.assemble`)
read the same `Problem`; this is the report's side, so a plan's
``predicted["total_s"]`` is its ILP objective by construction, and the suite
checks the two agree on every plan it makes (tests/test_optimal.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.solve.chain import chain_times_s
from autotp.solve.prefetch import prefetch_times_s
from autotp.solve.problem import Problem, used_items
from autotp.solve.recompute import recompute_effect
from autotp.solve.working import working_peak_bytes


@dataclass(frozen=True)
class StepTime:
    """One step, in seconds: what runs on the critical path, the gradient sums behind the backward pass, and
    ZeRO's all-gathers behind the next forward pass."""

    exposed_s: float  # compute and every collective the program waits for as it runs
    gradient_s: float  # gradient sums the runtime buckets behind the backward pass
    gradient_exposed_s: float  # the part of them the step still waits for
    gather_s: float = 0.0  # ZeRO's parameter all-gathers after the optimizer step, behind the next forward pass
    gather_exposed_s: float = 0.0  # the part of them the forward pass waits for

    @property
    def total_s(self) -> float:
        return self.exposed_s + self.gradient_exposed_s + self.gather_exposed_s

    @property
    def gradient_hidden_s(self) -> float:
        return self.gradient_s - self.gradient_exposed_s

    @property
    def gather_hidden_s(self) -> float:
        return self.gather_s - self.gather_exposed_s


def step_time(problem: Problem, choice: dict[str, int], recomputed=(), regathered=()) -> StepTime:
    """The step time of ``choice`` (group leader -> choice index), ``n`` layers of class ``k`` run twice for each
    ``(k, n)`` in ``recomputed``, every use of each kind in ``regathered`` gathered again in backward."""
    exposed = sum(group.cost_s[choice[name]] for name, group in problem.groups.items())
    exposed += recompute_effect(problem, choice, recomputed)[0] + regather_effect(problem, choice, regathered)[0]
    exposed += sum(table[choice[u]][choice[v]] for (u, v), table in problem.edges.items())
    for fanout in problem.fanouts:
        exposed += sum(fanout.cost_s[k] for k in used_items(fanout, choice))
    gradient, waited = chain_times_s(problem.chain, choice) if problem.chain else (0.0, 0.0)
    gather, delayed = prefetch_times_s(problem.prefetch, choice) if problem.prefetch else (0.0, 0.0)
    return StepTime(exposed, gradient, waited, gather, delayed)


def memory_bytes(problem: Problem, choice: dict[str, int], recomputed=(), regathered=()) -> int:
    """Peak bytes per device of ``choice``, as the ILP's memory rows bound them (at most:
    `autotp.solve.recompute`).

    With one micro-batch (`Problem.peak_in_backward`) the peak is the larger
    of two moments: as backward starts, every activation is alive and no
    gradient yet (the last step's were freed by ``zero_grad``); as it ends,
    every gradient and no activation. In between, backward frees a layer's
    activations as it makes that layer's gradients, so along a stack of
    layers the sum of the two moves linearly between them. With several
    micro-batches the earlier ones' gradients are held beside the last one's
    activations: every term at once.
    """
    _, freed, transient = recompute_effect(problem, choice, recomputed)
    groups = sum(group.memory_bytes[choice[name]] for name, group in problem.groups.items())
    total = groups + kept_bytes(problem, choice) - freed + transient - regather_effect(problem, choice, regathered)[1]
    total += working_peak_bytes(problem, choice)  # inference: the largest working set of one op
    if not problem.peak_in_backward:
        return total
    gradients = sum(group.gradient_bytes[choice[name]] for name, group in problem.groups.items())
    return max(total - gradients, state_bytes(problem, choice))


def state_bytes(problem: Problem, choice: dict[str, int]) -> int:
    """Parameters, gradients, optimizer state and buffers of ``choice``: what is alive as backward ends."""
    return sum(group.state_bytes[choice[name]] for name, group in problem.groups.items())


def kept_bytes(problem: Problem, choice: dict[str, int]) -> int:
    """Bytes of all-gathered inputs kept for backward that live on edges and fan-outs (not in a group's own)."""
    kept = sum(table[choice[u]][choice[v]] for (u, v), table in problem.edge_memory.items())
    for fanout in problem.fanouts:
        if fanout.memory_bytes:
            kept += sum(fanout.memory_bytes[k] for k in used_items(fanout, choice))
    return kept


def regather_effect(problem: Problem, choice: dict[str, int], kinds) -> tuple[float, int]:
    """``(seconds, bytes freed)`` of gathering again in backward every use of each kind in ``kinds``
    (`autotp.solve.regather`)."""
    seconds, freed = 0.0, 0
    for kind in kinds:
        r = problem.regather.get(kind)
        if r is None:
            continue
        for g, (s, b) in r.groups.items():
            seconds, freed = seconds + s[choice[g]], freed + b[choice[g]]
        for (u, v), (s, b) in r.edges.items():
            seconds, freed = seconds + s[choice[u]][choice[v]], freed + b[choice[u]][choice[v]]
        for f, fanout in enumerate(problem.fanouts):
            for k in used_items(fanout, choice):
                s, b = r.items.get((f, k), (0.0, 0))
                seconds, freed = seconds + s, freed + b
    return seconds, freed


def matmul_hidden_s(problem: Problem, choice: dict[str, int]) -> float:
    """The collective seconds (forward and backward) that collective matmuls hide under ``choice``, already off
    its step time (`autotp.solve.tp_overlap`): reported, so that compute plus collectives less all that is hidden
    adds up."""
    hidden = problem.tp_overlap
    return (sum(values[choice[g]] for g, values in hidden.groups.items())
            + sum(table[choice[u]][choice[v]] for (u, v), table in hidden.edges.items()))
