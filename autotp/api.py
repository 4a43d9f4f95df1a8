"""`plan()` and `parallelize()`: the whole pipeline as a short sequence of stage calls."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from autotp.capture import capture, example_specs, inputs_from_specs
from autotp.capture.beside import Beside
from autotp.capture.micro import batch_size, divisors, micro_batch
from autotp.cost.memory import AUTO, TERMS, check_precision, most_bytes, state_bytes
from autotp.cost.profile import load_profile
from autotp.counts import DEFER_OVER, leads, likely_count, search_in_order
from autotp.errors import MemoryLimitError, PlanError
from autotp.gcpause import collector_paused
from autotp.graph import build_opgraph
from autotp.graph.resize import NotProportional, derivable, resized
from autotp.lanes import lane_count, lane_order, search_in_lanes
from autotp.lower import lower
from autotp.materialize import StateDictSource, check_materialized, prepare_weights
from autotp.mesh import Mesh
from autotp.progress import Stages, stages_or_silent
from autotp.capture.scopes import node_scopes
from autotp.runtime.groups import device_mesh_groups, plan_device_mesh
from autotp.runtime.mode import fix_mode
from autotp.solve.assemble import assemble_plan, chosen_strategies, plan_memory
from autotp.solve.constraints import apply_constraints
from autotp.solve.ilp import MemoryInfeasible, solve
from autotp.solve.plan import Plan
from autotp.solve.problem import build_problem
from autotp.solve.recompute import LAYERS
from autotp.strategies import default_registry, enumerate_strategies
from autotp.strategies.enumerate import prune_unreachable
from autotp.units import format_bytes, parse_bytes

DEFAULT_PROFILE = "h100-hgx"


def as_mesh(mesh) -> Mesh:
    """An autotp `Mesh` from a `Mesh`, a shape (``"2x4"``) or a torch ``DeviceMesh`` (links nvlink: pass
    ``Mesh.from_device_mesh(device_mesh, links=...)`` to name them)."""
    if isinstance(mesh, Mesh):
        return mesh
    if _is_device_mesh(mesh):
        return Mesh.from_device_mesh(mesh)
    return Mesh(mesh)


def _is_device_mesh(mesh) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch without distributed
        return False
    return isinstance(mesh, DeviceMesh)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


MEMORY_RESERVE = 0.05  # of the device's memory, kept back by the default limit: CUDA context, allocator, NCCL buffers


def default_memory_limit(profile) -> int:
    """A plan must fit the device: its memory less `MEMORY_RESERVE`. An inference plan's memory is its weights,
    buffers (a key/value cache) and largest working set: served models are split to fit as trained ones are."""
    return int(profile.device["memory_bytes"] * (1 - MEMORY_RESERVE))


def limit_bytes(memory_limit, profile) -> int | None:
    """``memory_limit`` (`plan`'s: ``"auto"``, ``"80GB"``, bytes or None) in bytes under a loaded ``profile``."""
    if memory_limit == AUTO:
        return default_memory_limit(profile)
    return parse_bytes(memory_limit) if memory_limit is not None else None


@collector_paused()
def plan(model, mesh, example_inputs=(), example_kwargs=None, *, training: bool = True,
         profile=DEFAULT_PROFILE, pin: dict | None = None, allow=None, registry=None,
         time_limit_s: float | None = None, memory_limit=AUTO, overlap_gradients: bool = True,
         bucket_cap_mb: float = 25.0, whole_outputs: bool = False, share_layers: bool = True, solver: str = "auto",
         replay_layers: bool = True, precision: str = AUTO, optimizer_sharding: bool = True,
         recompute: bool | str = True, micro_batches=AUTO, regather: bool = True, overlap_tp: bool = True,
         progress: Stages | bool | None = None, workers=AUTO) -> Plan:
    """Choose a placement for every parameter and op of ``model`` on ``mesh``: the fastest step that fits.

    ``pin`` fixes parameter placements (``{"fc1.weight": ("S(0)",)}``) and lets
    the ILP choose the rest; ``allow(op, strategy)`` keeps only some strategies
    (see ``autotp.solve.constraints``). Nothing is allocated: ``model`` and the
    inputs may live on the ``meta`` device.

    The ILP minimises the step time the plan reports (``predicted["total_s"]``),
    priced as `parallelize` runs the plan by default (docs/cost-model.md):

    * ``overlap_gradients``: the gradient sums of data parallelism run in
      buckets of ``bucket_cap_mb`` (DDP's 25 MiB) behind the backward pass;
      False runs (and prices) them where they are used;
    * ``whole_outputs``: every output comes back replicated; by default an
      output split by rows stays so (each rank its own rows, as with DDP) and
      anything else is made whole; ``plan.io`` says each output's layout;
    * ``memory_limit`` (``"80GB"`` or bytes) bounds the predicted memory per
      device (parameters, gradients, Adam state and saved activations). The
      default, ``"auto"``, is the profile's device memory less 5% (an
      inference plan counts its weights and buffers, such as a key/value
      cache); ``None`` lifts it. When nothing fits,
      `MemoryLimitError` says the least any plan needs and which term dominates it;
    * ``precision`` is how the parameters are trained, for their memory:
      ``"fp32"``, ``"mixed"`` (bf16 weights, fp32 gradients, master weights
      and Adam moments: 18 bytes a parameter) or ``"bf16"``; ``"auto"`` reads
      each parameter's dtype (`autotp.cost.memory`);
    * ``optimizer_sharding`` lets the ILP split a parameter's optimizer state
      over the mesh axes where the parameter is whole (ZeRO-1), paying an
      all-gather of the parameter after each step; it does so when memory
      binds. `autotp.runtime.shard_optimizer` builds the optimizer that does it;
    * ``recompute`` lets the ILP recompute classes of identical layers in
      backward (activation checkpointing), paying their forward compute
      again for the activations it frees; it does so when memory binds, and
      ``plan.recompute`` names the layers (`autotp.solve.recompute`).
      ``True`` recomputes a class whole or not at all; ``"layers"`` any
      number of its layers (Megatron's ``--recompute-num-layers``: finer,
      and slower to solve); ``False`` keeps every activation;
    * ``regather`` lets the ILP keep only the shard of an all-gathered input
      that backward reads, and gather it again in backward (Megatron's
      sequence-parallel inputs; FSDP's parameters resharded after forward),
      for weights and for activations apart; it does so when memory binds,
      and ``plan.regather`` names the kinds (`autotp.solve.regather`);
    * ``overlap_tp`` runs an all-gather into a matmul, and a reduce-scatter
      of a matmul's product, as a collective matmul: a ring whose chunks
      travel while the matmul works on the rows that have arrived (Megatron's
      tensor-parallel overlap, PyTorch's async TP), forward and backward, and
      credits each such collective what ``(n - 1)/n`` of the matmul hides
      (`autotp.cost.collective_matmul`; ``predicted["overlap_hidden_s"]``);
      False runs and prices them whole, before or after the matmul;
    * ``micro_batches``: the example batch is one optimizer step's; the plan
      may run it as k micro-batches of batch/k (gradients summed once, after
      the last), ``plan.micro_batches`` says k and `autotp.runtime.accumulate`
      runs them. ``"auto"`` (training) tries k = 1, 2, ... (divisors of the
      batch) while memory binds and keeps the fastest plan (`likely_count`
      is searched first where it splits the batch into more than
      `DEFER_OVER` micro-batches and memory may bind at it, `leads`, or
      where k = 1 is memory bound by more than `DEFER_OVER` times, so its
      plan cuts the others' search short); an int fixes k;
    * ``workers``: how many micro-batch counts are searched at once, each in
      a process forked from this one (`autotp.lanes`: the same plan as one
      at a time); ``"auto"`` is one per core this process may use, ``1``
      searches them in turn here.

    ``progress`` (``True``, or an `autotp.progress.Stages`) reports each stage and its time
    on stderr; by default nothing is printed. ``share_layers`` gives identical
    layers one choice in the ILP, so solve time stays flat as depth grows
    (`autotp.solve.layers`; a restriction: docs/planning.md). ``solver`` is
    ``"auto"`` (HiGHS, or CBC when highspy is missing), ``"cbc"`` or ``"highs"``.
    ``replay_layers`` traces the first few of a deep stack of identical layers
    and copies the last for the rest, after checking that they repeat
    (`autotp.capture.replay`; the plan records it, so `parallelize` captures alike).
    """
    started, stages = time.perf_counter(), stages_or_silent(progress)
    example_inputs, example_kwargs = _as_tuple(example_inputs), dict(example_kwargs or {})
    options = dict(training=training, profile=profile, pin=pin, allow=allow, registry=registry,
                   time_limit_s=time_limit_s, memory_limit=memory_limit, overlap_gradients=overlap_gradients,
                   bucket_cap_mb=bucket_cap_mb, whole_outputs=whole_outputs, share_layers=share_layers,
                   solver=solver, precision=precision, optimizer_sharding=optimizer_sharding, recompute=recompute,
                   regather=regather, overlap_tp=overlap_tp)
    counts = micro_batch_counts(micro_batches, training, example_inputs, example_kwargs)
    likely = likely_count(counts, as_mesh(mesh), batch_size(example_inputs, example_kwargs))
    job = _CountJob(_Captures(model, example_inputs, example_kwargs, replay_layers, stages), mesh, options, stages,
                    likely)
    lanes = lane_count(workers, len(counts))
    try:
        if lanes > 1 and job.binds_surely():  # lanes will search the counts: their second capture starts now
            job.captures.capture_beside(lane_order(counts, likely, leads(counts, likely))[0])
        # the likeliest count leads only where memory may bind at it (then it may at one micro-batch too)
        ahead = leads(counts, likely) and job.may_bind(likely)
        if lanes > 1 and not ahead and not job.may_bind(counts[0]):
            lanes = 1
        tally = (search_in_lanes(job, counts, likely, lanes, ahead) if lanes > 1
                 else search_in_order(job, counts, likely, ahead))
    finally:
        job.captures.close()
    best = tally.result()
    best.stats["plan_s"] = time.perf_counter() - started
    return best


def micro_batch_counts(micro_batches, training: bool, example_inputs, example_kwargs) -> list[int]:
    """The numbers of micro-batches to try: the batch's divisors for ``"auto"`` (training), else the one given."""
    batch = batch_size(example_inputs, example_kwargs)
    if micro_batches == AUTO:
        return divisors(batch) if training and batch else [1]
    if not isinstance(micro_batches, int) or micro_batches < 1 or (micro_batches > 1 and not training):
        raise PlanError(f"micro_batches must be 'auto' or a positive int (and 1 for inference), not {micro_batches!r}")
    if micro_batches > 1 and (not batch or batch % micro_batches):
        raise PlanError(f"a batch of {batch} does not split into {micro_batches} micro-batches: pick a divisor of "
                        f"it ({', '.join(map(str, divisors(batch or 1)))})")
    return [micro_batches]


@dataclass(frozen=True)
class Captured:
    """A model captured once, to be planned several ways (autotp's plan and its baselines)."""

    gm: torch.fx.GraphModule  # of a graph read off two others or captured beside the first (`_Captures`), the
    # first's: its scopes hold alike
    graph: object  # OpGraph
    specs: dict  # the example inputs' shapes, saved with the plan


def capture_model(model, example_inputs=(), example_kwargs=None, replay_layers: bool = True,
                  progress: Stages | None = None) -> Captured:
    """Stage 1 of `plan`: the model's ATen graph and `OpGraph` (see `autotp.capture`)."""
    stages = stages_or_silent(progress)
    example_inputs, example_kwargs = _as_tuple(example_inputs), dict(example_kwargs or {})
    with stages.stage("capturing") as stage:
        gm = capture(model, example_inputs, example_kwargs, replay_layers=replay_layers)
        graph = build_opgraph(gm, _placeholder_grads(gm, example_inputs, example_kwargs))
        stage.detail = f"{len(graph):,} ops{_replay_detail(gm)}"
    return Captured(gm, graph, _specs(example_inputs, example_kwargs, replay_layers))


def _specs(example_inputs: tuple, example_kwargs: dict, replay_layers: bool) -> dict:
    """What a capture saves with the plan: the example inputs' shapes, and whether layers were replayed."""
    return {**example_specs(example_inputs, example_kwargs), "replay_layers": replay_layers}


class _Captures:
    """The model captured at each micro-batch count `plan` tries: the first two counts for real, and the rest,
    where the two show every shape proportional to the batch, read off them (`autotp.graph.resize`: a fraction
    of a second, where a capture of Llama-2-70B takes 1.3 to 1.9 s); counts of one sample are always captured.
    Where lanes will search the counts, the second real capture is made beside the first (`capture_beside`)."""

    def __init__(self, model, example_inputs: tuple, example_kwargs: dict, replay_layers: bool, stages: Stages):
        self.model, self.inputs, self.kwargs, self.replay_layers, self.stages = (
            model, example_inputs, example_kwargs, replay_layers, stages)
        self.batch = batch_size(example_inputs, example_kwargs)
        self.real: list[tuple[int, Captured]] = []  # (micro-batch size, capture) of the first two derivable
        self.proportional = True  # False once the two captures showed a shape that is not
        self.ahead: dict[int, tuple] = {}  # (capture, seconds) of counts captured before asked for (`capture_ahead`)
        self.beside: dict[int, Beside] = {}  # the count captured in a forked process (`capture_beside`)

    def capture_beside(self, order: list[int]) -> None:
        """Start capturing, in a process forked now, the second count of ``order`` that later counts are read
        off, while this process captures the first (`autotp.capture.beside`)."""
        derivable_counts = [k for k in order if self.batch and derivable(self.batch // k)]
        if len(derivable_counts) < 2 or self.real:
            return
        k = derivable_counts[1]
        args, kwargs = micro_batch(self.inputs, self.kwargs, k)

        def capture():
            lines = io.StringIO()
            stages = Stages(enabled=self.stages.enabled, stream=lines)
            captured = capture_model(self.model, args, kwargs, self.replay_layers, stages)
            return captured, lines.getvalue(), stages.times["capturing"]

        self.beside[k] = Beside(capture)

    def close(self) -> None:
        """Stop a capture beside this process that is no longer wanted."""
        for process in self.beside.values():
            process.stop()
        self.beside.clear()

    def capture_ahead(self, k: int) -> None:
        """Capture count ``k`` now if later counts are to be read off it: `autotp.lanes` forks each count's
        search, so those captures must be made in the process that forks them."""
        size = self.batch // k if self.batch else None
        if size is not None and derivable(size) and len(self.real) < 2:
            self.peek(k)

    def peek(self, k: int) -> Captured:
        """Count ``k`` captured now and kept, with the time it took, for `at` (its count's capture stage)."""
        if k not in self.ahead:
            captured = self.at(k)
            self.ahead[k] = captured, self.stages.times["capturing"]
        return self.ahead[k][0]

    def at(self, k: int, stages: Stages | None = None) -> Captured:
        stages = stages or self.stages
        if k in self.ahead:  # its time is the count's own capture stage, as if it were captured now
            captured, stages.times["capturing"] = self.ahead.pop(k)
            return captured
        args, kwargs = micro_batch(self.inputs, self.kwargs, k)
        size = self.batch // k if self.batch else None
        if size is None or not derivable(size):
            return capture_model(self.model, args, kwargs, self.replay_layers, stages)
        if len(self.real) == 2 and self.proportional:
            (first_size, first), (second_size, second) = self.real
            with stages.stage("capturing") as stage:
                try:
                    graph = resized(first.graph, first_size, second.graph, second_size, size)
                except NotProportional as exc:
                    self.proportional, graph = False, None
                    stage.detail = f"not read off batches {first_size} and {second_size} ({exc})"
                else:
                    stage.detail = f"{len(graph):,} ops (batch {size} read off batches {first_size} and {second_size})"
            if graph is not None:
                return Captured(first.gm, graph, _specs(args, kwargs, self.replay_layers))
        captured = self._made_beside(k, args, kwargs, stages) or capture_model(self.model, args, kwargs,
                                                                              self.replay_layers, stages)
        if len(self.real) < 2:
            self.real.append((size, captured))
        return captured

    def _made_beside(self, k: int, args: tuple, kwargs: dict, stages: Stages) -> Captured | None:
        """Count ``k`` as captured beside this process (`capture_beside`), its progress line and time told here,
        with the first capture's module standing for its own (as for a graph read off two); None where it was
        not captured so, failed, or replayed other than the first did."""
        process = self.beside.pop(k, None)
        made = process.result() if process is not None else None
        if made is None or not self.real:
            return None
        graph, lines, seconds, report = made
        gm = self.real[0][1].gm
        if report != gm.meta["autotp_capture"]:
            return None
        stages.write(lines)
        stages.times["capturing"] = seconds
        return Captured(gm, graph, _specs(args, kwargs, self.replay_layers))


@collector_paused()
def plan_captured(captured: Captured, mesh, *, training: bool = True, profile=DEFAULT_PROFILE, pin=None,
                  allow=None, registry=None, time_limit_s=None, memory_limit=AUTO, overlap_gradients: bool = True,
                  bucket_cap_mb: float = 25.0, whole_outputs: bool = False, share_layers: bool = True,
                  solver: str = "auto", precision: str = AUTO, optimizer_sharding: bool = True,
                  recompute: bool | str = True, micro_batches: int = 1, beat_s: float | None = None,
                  regather: bool = True, overlap_tp: bool = True, progress: Stages | None = None,
                  defer_over: float | None = None, costed=None, found=None, unlimited_bound: bool = True) -> Plan:
    """Stages 2 to 5 of `plan` on a captured model: strategies, costs, the ILP, the `Plan`.

    ``beat_s``: raise `NoBetterPlan` as soon as the fastest plan, without the
    memory limit or under it, is no faster; ``defer_over``: raise
    `MemoryBinds` rather than search under a limit the fastest plan needs
    more than that many times; ``costed``: the problem `cost_captured` gave
    for the same arguments (stages 2 and 3 are skipped); ``found``: told the
    step time of each better plan the search under the limit proves, as it
    goes, and of its first plan where that is close to its bound
    (`autotp.solve.ilp.solve`); ``unlimited_bound=False``: ``beat_s`` is not
    first tried on the bound without the memory limit (`autotp.solve.ilp.solve`).
    """
    started, stages = time.perf_counter(), stages_or_silent(progress)
    mesh, profile, graph = as_mesh(mesh), load_profile(profile), captured.graph
    problem = costed or cost_captured(captured, mesh, training=training, profile=profile, pin=pin, allow=allow,
                                      registry=registry, overlap_gradients=overlap_gradients,
                                      bucket_cap_mb=bucket_cap_mb, whole_outputs=whole_outputs,
                                      share_layers=share_layers, precision=precision,
                                      optimizer_sharding=optimizer_sharding, recompute=recompute,
                                      micro_batches=micro_batches, regather=regather, overlap_tp=overlap_tp,
                                      progress=stages)
    limit = limit_bytes(memory_limit, profile)
    with stages.stage("solving ILP") as stage:
        try:
            solution = solve(problem, time_limit_s, limit, solver, beat_s=beat_s, defer_over=defer_over,
                             found=found, unlimited_bound=unlimited_bound)
        except MemoryInfeasible as exc:
            raise memory_limit_error(graph, problem, exc.smallest, mesh, training, limit, whole_outputs) from None
        stage.detail = f"{solution.variables:,} variables"
    result = assemble_plan(graph, problem, solution, mesh, profile, training, dict(captured.specs), whole_outputs)
    result.scopes = node_scopes(captured.gm)
    result.stats = {"plan_s": time.perf_counter() - started, "solve_s": solution.solve_s,
                    "stages_s": dict(stages.times), "solver": solution.solver, "memory_limit": limit,
                    "gap": solution.gap or 0.0,  # > 0 only when time_limit_s stopped the solver early
                    "constrained": bool(pin or allow),  # the search space was narrowed: baselines may lie outside
                    "memory_bound": solution.limited,  # the fastest plan did not fit: the limit shaped this one
                    "capture": captured.gm.meta["autotp_capture"]}
    return result


@collector_paused()
def cost_captured(captured: Captured, mesh, *, training: bool = True, profile=DEFAULT_PROFILE, pin=None,
                  allow=None, registry=None, overlap_gradients: bool = True, bucket_cap_mb: float = 25.0,
                  whole_outputs: bool = False, share_layers: bool = True, precision: str = AUTO,
                  optimizer_sharding: bool = True, recompute: bool | str = True, micro_batches: int = 1,
                  regather: bool = True, overlap_tp: bool = True, progress: Stages | None = None):
    """Stages 2 and 3 of `plan` on a captured model: every op's strategies, and the `Problem` that costs them
    (`autotp.solve.problem.build_problem`), for `plan_captured` to solve."""
    stages, mesh, profile = stages_or_silent(progress), as_mesh(mesh), load_profile(profile)
    precision = check_precision(precision)
    if recompute not in (True, False, LAYERS):
        raise PlanError(f"recompute={recompute!r}: use True (whole layer classes), {LAYERS!r} (any number of "
                        "a class's layers) or False")
    graph = captured.graph
    with stages.stage("enumerating strategies") as stage:
        strategies = enumerate_strategies(graph, mesh.shape, registry or default_registry(),
                                          optimizer_sharding=training and optimizer_sharding)
        apply_constraints(graph, strategies, pin, allow)
        prune_unreachable(graph, strategies)
        stage.detail = f"{sum(len(s) for s in strategies.by_node.values()):,} strategies"
    with stages.stage("costing"):
        problem = build_problem(graph, strategies, mesh, profile, training, overlap_gradients, share_layers,
                                whole_outputs, int(bucket_cap_mb * 2**20), precision, recompute, micro_batches,
                                overlap_tp)
        if not regather:
            problem.regather = {}
    return problem


_SOLVE_ONLY = ("time_limit_s", "memory_limit", "solver")  # `plan_captured`'s options that `cost_captured` lacks


@dataclass
class _CountJob:
    """Everything `plan` searches a micro-batch count with, but the count (`autotp.counts`): what each lane
    inherits when it forks (`autotp.lanes`)."""

    captures: _Captures
    mesh: object
    options: dict  # `plan_captured`'s keyword arguments
    stages: Stages
    likely: int | None = None  # `autotp.counts.likely_count`

    def prepare(self, k: int, stages: Stages):
        """The model captured at ``k`` micro-batches (or read off two captures), and its costed problem."""
        captured = self.captures.at(k, stages)
        costing = {key: value for key, value in self.options.items() if key not in _SOLVE_ONLY}
        return captured, cost_captured(captured, self.mesh, micro_batches=k, progress=stages, **costing)

    def solve(self, k: int, captured: Captured, problem, beat_s: float | None, defer: bool, stages: Stages,
              found=None) -> Plan:
        """``k``'s plan, or `NoBetterPlan` against ``beat_s``: below the likeliest count, which the plan to beat
        comes from as a rule, more micro-batches only add work, and the bound without the limit is skipped."""
        return plan_captured(captured, self.mesh, micro_batches=k, progress=stages, beat_s=beat_s, costed=problem,
                             defer_over=DEFER_OVER if defer else None, found=found,
                             unlimited_bound=self.likely is None or k >= self.likely, **self.options)

    def may_bind(self, k: int) -> bool:
        """Whether the memory limit may bind at ``k`` micro-batches: not where every tensor of the step, unsharded
        and counted over (`autotp.cost.memory.most_bytes`), fits it. Then ``k``'s plan is the plan, and no other
        count is worth a lane (a fork and a second capture took a small GPT's plan from 1.35 s to 1.7 s)."""
        limit, precision = self._limit_and_precision()
        return limit is not None and most_bytes(self.captures.peek(k).graph, self.options["training"], precision) > limit

    def binds_surely(self) -> bool:
        """Whether the memory limit may bind whatever the capture shows: the model's trainable parameters' state
        alone, which `most_bytes` counts whole, is over it (Llama-2-70B's on 4x8: 1,260 GB against 76 GB).
        Then lanes will search the counts, and their second capture may start before the first is made, beside
        it (a model below the limit plans one count in this process: a fork and a second capture took a small
        GPT's plan from 1.35 s to 1.7 s, `may_bind`)."""
        limit, precision = self._limit_and_precision()
        state = sum(p.numel() * sum(state_bytes(p.dtype.itemsize, precision))
                    for p in self.captures.model.parameters() if p.requires_grad)
        return limit is not None and self.options["training"] and state > limit

    def _limit_and_precision(self) -> tuple[int | None, str]:
        """The memory limit in bytes (None: none) and the training precision, as the options give them."""
        return (limit_bytes(self.options["memory_limit"], load_profile(self.options["profile"])),
                check_precision(self.options["precision"]))

    def stages_to(self, stream) -> Stages:
        """A reporter like this one's, writing to ``stream``."""
        return Stages(enabled=self.stages.enabled, stream=stream)


def _replay_detail(gm) -> str:
    """`` (76 layers replayed)`` or `` (traced in full: <why>)`` for the capture stage's progress line."""
    report = gm.meta["autotp_capture"]
    if report["replayed"]:
        return f" ({sum(report['replayed'].values())} layers replayed)"
    return f" (traced in full: {report['traced_in_full']})" if report["traced_in_full"] else ""


def replays_layers(plan: Plan) -> bool:
    """Whether ``plan`` was captured with layer replay; plans saved before it existed were not."""
    return bool(plan.inputs.get("replay_layers", False))


_HINTS = {
    "parameters": "split the model over more devices (a larger tensor-parallel axis)",
    "gradients": "split the model over more devices (a larger tensor-parallel axis)",
    "optimizer": "split the model over more devices (with optimizer_sharding, a data-parallel axis splits the "
                 "optimizer state and gradients too)",
    "activations": "use a smaller batch or sequence per step",
    "buffers": "split the model over more devices",
}


def memory_limit_error(graph, problem, smallest, mesh, training, limit, whole_outputs: bool = False) -> MemoryLimitError:
    """The error for a limit no plan meets: the least memory any plan needs, and its largest term."""
    terms = plan_memory(graph, problem, smallest, chosen_strategies(problem, smallest), mesh, training, whole_outputs)
    dominant = max(TERMS, key=lambda t: terms[t])
    levers = ["every split of every op"]
    if any(s.optimizer_axes for options in problem.strategies.by_node.values() for s in options):
        levers.append("optimizer state and gradients split where weights are whole (ZeRO-1 and 2)")
    if problem.regather:
        levers.append("all-gathered inputs gathered again in backward")
    if problem.recompute:
        levers.append(f"recomputation of {len(problem.recompute)} layer class(es)")
    if problem.micro_batches > 1:
        levers.append(f"{problem.micro_batches} micro-batches a step")
    return MemoryLimitError(
        f"no plan fits {format_bytes(limit)} per device on {mesh}: with {', '.join(levers)}, the smallest any "
        f"plan reaches is {format_bytes(terms['total'])}, of which {dominant} {format_bytes(terms[dominant])}; "
        f"raise memory_limit or {_HINTS[dominant]}")


def _placeholder_grads(gm, args: tuple, kwargs: dict) -> dict[str, bool]:
    """Which graph inputs want gradients: export makes one placeholder per leaf of ``(args, kwargs)``."""
    leaves = pytree.tree_leaves((args, kwargs))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return {name: isinstance(leaf, torch.Tensor) and leaf.requires_grad for name, leaf in zip(names, leaves)}


def parallelize(model, plan: Plan, rank: int | None = None, groups=None, *, device_mesh=None,
                batch_collectives: bool = False, overlap: bool = False, counter=None, weights=None,
                device=None, captured: Captured | None = None) -> torch.fx.GraphModule:
    """This rank's program for ``plan``: a GraphModule with sharded parameters and collectives.

    Call it on every rank of an initialised process group whose size is the
    mesh's, or, with ``device_mesh`` (a torch ``DeviceMesh`` of the plan's
    shape, e.g. from ``init_device_mesh``, possibly a sub-mesh of a larger
    world), on every rank of that mesh: its groups carry the collectives.
    The program runs in the plan's mode (``plan.training``): ``.train()``
    and ``.eval()`` accept that mode and refuse the other with a `PlanError`
    (`autotp.runtime.mode`). Each rank then calls the result with the whole inputs, or with
    its own piece of each (``plan.io["inputs"]``; `autotp.runtime.local_inputs`
    cuts them), and gets its outputs back as ``plan.io["outputs"]`` says.
    Gradient sums of data parallelism run as the plan priced them
    (``plan.runtime``): in buckets behind the backward pass
    (`autotp.lower.reducer`), summed into ``.grad`` when ``backward()`` returns.
    ``batch_collectives`` merges independent activation collectives of one
    kind and axis into one, ``overlap`` starts each as soon as its input
    exists and waits just before its first use: both exact, both off by
    default because the cost model does not price them (docs/benchmarks.md).
    ``counter`` (an `autotp.lower.collectives.CommCounter`) records every collective issued.
    ``weights`` (an `autotp.materialize` source) supplies this rank's shards, so
    ``model`` may live on ``meta``; they are placed on ``device`` (default CPU).
    ``device`` without ``weights`` cuts the shards out of ``model``'s own
    weights and places them, its buffers and the tensors the program creates
    on ``device`` (``cuda:<local rank>``), leaving ``model`` where it is.
    ``captured`` (`capture_for`: ``model`` captured at the plan's inputs) is
    lowered instead of capturing ``model`` here, where ranks fork from one
    process that captured it once: a model's export is most of a rank's set-up
    (39.8 of 52.6 s of a rank of tests/test_transformers.py). The lowering
    rewrites it in place, so it serves one call.
    """
    import torch.distributed as dist

    if captured is not None:
        _check_captured(captured, model)
    if device_mesh is None and groups is None:
        device_mesh = plan_device_mesh(plan.mesh, _mesh_device_type(device, model))
    if device_mesh is not None:
        groups, rank = device_mesh_groups(device_mesh, plan.mesh)
    rank = dist.get_rank() if rank is None else rank
    captured = captured if captured is not None else capture_for(model, plan)
    gm, graph = captured.gm, captured.graph
    gm.meta[_LOWERED] = True
    if weights is None and device is not None:  # the model's own weights, each rank's shards moved to device
        weights = StateDictSource(model.state_dict())
    loader = (prepare_weights(gm, weights, plan.mesh.shape, device, captured_on=_device_of(model))
              if weights is not None else None)
    local = lower(gm, plan, rank, groups, graph=graph, batch=batch_collectives, overlap=overlap, counter=counter,
                  load_shard=loader, device_mesh=device_mesh)
    if weights is not None and torch.device(device or "cpu").type != "meta":  # meta asked for: nothing to check
        check_materialized(local)
    return fix_mode(local, plan.training)


def capture_for(model, plan: Plan) -> Captured:
    """``model`` captured at ``plan``'s inputs as `parallelize` captures it, for ``parallelize(..., captured=)``:
    made once in a process whose ranks fork from it, where each would otherwise capture the model again."""
    args, kwargs = inputs_from_specs(plan.inputs, device=_device_of(model))
    return capture_model(model, args, kwargs, replay_layers=replays_layers(plan))


_LOWERED = "autotp_lowered"  # a captured program's meta key, set once the lowering has rewritten it


def _check_captured(captured: Captured, model) -> None:
    """A `PlanError` unless ``captured`` is ``model``'s (its parameters the model's own) and not lowered yet."""
    if captured.gm.meta.get(_LOWERED):
        raise PlanError("captured was lowered already (the lowering rewrites it in place): capture the model "
                        "again with autotp.api.capture_for(model, plan) for each parallelize")
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for p in captured.gm.parameters()):
        raise PlanError("captured holds parameters that are not this model's: pass the model it was captured "
                        "from (autotp.api.capture_for(model, plan)), or leave captured out")


def _mesh_device_type(device, model) -> str:
    """The device type of the mesh parallelize builds: ``device``'s, or the model's where it is not meta."""
    where = torch.device(device) if device is not None else _device_of(model)
    return "cpu" if where.type == "meta" else where.type


def _device_of(model) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
