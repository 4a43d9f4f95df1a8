"""Generation planned as a server runs it: how many devices one replica spans, and how many rows it decodes at once.

A training step has one shape; a server chooses two numbers that
`autotp.decoding.plan_decoding` takes as given. Splitting a model over more
devices shortens each token (more compute and memory bandwidth on it) but
adds collectives to every step and leaves fewer replicas; a larger batch
serves more requests per step, up to what the memory left beside the
weights holds of cache and working set. `plan_serving` weighs both:

* **devices per replica** ``d``: every divisor of the mesh's innermost axis
  (on the fast links), and the whole mesh; the rest of the mesh serves
  other requests as ``mesh.size // d`` replicas of the same plan. A degree
  whose weights alone exceed the limit is set aside without planning;
* **the batch**: the largest the memory limit allows on ``d`` devices, as
  a line predicts it. A plan's memory is its weights and the cache and
  working set, which grow with the rows: the line through the weights at no
  rows and the plan at ``batch_size`` gives a batch at the limit, which is
  planned; the line through the last two plans gives the next, planned while
  it grows. Where memory is a line in the rows (as here, where layouts do
  not change with the batch), that is the largest batch that fits; a batch
  whose plan does not fit is reduced by a tenth until one does, which may
  stop short of the largest.

``target="latency"`` takes the fastest token at ``batch_size`` (1 unless
given); ``target="throughput"`` the most generated tokens per second per
device, the prefill counted, among the options whose token meets
``latency_s`` when it is given. The summary puts every option beside the
chosen one. `parallelize_serving` builds this rank's replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.decoding import DecodingPlans, RankDecoder, parallelize_decoding, plan_decoding
from autotp.errors import MemoryLimitError, PlanError
from autotp.mesh import Mesh
from autotp.units import format_bytes

TARGETS = ("latency", "throughput")
_SHRINK = 0.9  # the batch's factor while its plan does not fit
_TRIES = 4  # plans at growing batches, and at shrinking ones, before the search of one degree stops


@dataclass(frozen=True)
class ServingOption:
    """One way to serve: ``replicas`` copies of a plan over ``mesh`` (``devices`` each) at ``batch`` rows; ``plans``
    is None where it does not fit, and ``note`` says why."""

    mesh: Mesh
    replicas: int
    batch: int
    plans: DecodingPlans | None = None
    note: str = ""

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def latency_s(self) -> float:
        """Predicted seconds per decoded token (one decode step)."""
        return self.plans.decode.predicted["total_s"]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second per device: ``batch`` rows of ``max_length - prompt_length`` new tokens, after
        their prefill, over the replica's devices."""
        new = self.plans.max_length - self.plans.prompt_length
        seconds = self.plans.prefill.predicted["total_s"] + new * self.latency_s
        return self.batch * new / (seconds * self.devices)

    @property
    def memory_bytes(self) -> int:
        """Per device: weights, cache and the larger step's working set."""
        return self.plans.peak_bytes


@dataclass(frozen=True)
class ServingPlan:
    """The chosen option, and every option weighed, for ``target``."""

    chosen: ServingOption
    options: tuple[ServingOption, ...]
    target: str
    latency_s: float | None = None

    @property
    def plans(self) -> DecodingPlans:
        return self.chosen.plans

    def summary(self) -> str:
        """Each option's devices, replicas, batch, latency, throughput and memory per device; the chosen one
        marked."""
        goal = self.target + (f" within {self.latency_s * 1e3:.3f} ms a token" if self.latency_s else "")
        lines = [f"serving plan for {goal}:",
                 "   devices  replicas  batch  ms/token  tokens/s/device  memory/device",
                 "   -------  --------  -----  --------  ---------------  -------------"]
        for option in self.options:
            mark = "-> " if option is self.chosen else "   "
            if option.plans is None:
                lines.append(f"{mark}{option.devices:>7}  {option.replicas:>8}  {'':>5}  {option.note}")
                continue
            lines.append(f"{mark}{option.devices:>7}  {option.replicas:>8}  {option.batch:>5}  "
                         f"{option.latency_s * 1e3:>8.3f}  {option.tokens_per_s:>15.1f}  "
                         f"{format_bytes(option.memory_bytes):>13}")
        return "\n".join(lines) + "\n\n" + self.chosen.plans.summary()


def plan_serving(model, mesh, prompt_length: int, max_length: int, *, target: str = "throughput",
                 latency_s: float | None = None, batch_size: int = 1, max_batch: int = 4096,
                 **options) -> ServingPlan:
    """The serving plan of ``model`` (a transformers causal LM) on ``mesh`` for ``target`` (``"latency"`` or
    ``"throughput"``); ``options`` go to `plan_decoding` (``profile``, ``memory_limit``, ...). See the module's
    docstring for what is weighed. ``latency_s`` bounds the time a token of the chosen option, for either target."""
    from autotp.api import AUTO, DEFAULT_PROFILE, limit_bytes
    from autotp.cost.profile import load_profile

    if target not in TARGETS:
        raise PlanError(f"unknown serving target {target!r}: use 'latency' (the fastest token at batch_size) or "
                        "'throughput' (the most tokens per second per device, within latency_s if given)")
    if batch_size < 1 or max_batch < batch_size:
        raise PlanError(f"batch_size ({batch_size}) must be at least 1 and at most max_batch ({max_batch})")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    limit = limit_bytes(options.get("memory_limit", AUTO), load_profile(options.get("profile", DEFAULT_PROFILE)))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    found = []
    for sub in replica_meshes(mesh):
        trial = _Trial(model, sub, mesh.size // sub.size, prompt_length, max_length, options)
        if limit is not None and weights / sub.size > limit:
            found.append(ServingOption(sub, trial.replicas, batch_size, note=f"weights alone need "
                                       f"{format_bytes(weights // sub.size)} a device"))
            continue
        first = trial.option(batch_size)
        found.append(first)
        if target == "throughput" and first.plans is not None:
            found.extend(_larger(trial, first, limit, max_batch))
    return ServingPlan(_choose(found, target, latency_s, batch_size), tuple(found), target, latency_s)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The meshes one replica may span, most devices first: the whole mesh, then each divisor of its innermost
    axis, on that axis's links and under its name."""
    inner, link, name = mesh.shape[-1], mesh.links[-1], mesh.names[-1]
    return [mesh] + [Mesh(d, names=(name,), links=link) for d in range(inner, 0, -1)
                     if inner % d == 0 and d != mesh.size]


@dataclass(frozen=True)
class _Trial:
    """What every plan of one replica mesh is made with: `option` plans it at a batch."""

    model: object
    mesh: Mesh
    replicas: int
    prompt_length: int
    max_length: int
    options: dict

    def option(self, batch: int) -> ServingOption:
        """The option at ``batch`` rows; without plans, and the reason, where no plan fits the memory limit."""
        try:
            plans = plan_decoding(self.model, self.mesh, batch, self.prompt_length, self.max_length, **self.options)
        except MemoryLimitError as error:
            return ServingOption(self.mesh, self.replicas, batch, note=f"no plan fits: {str(error).splitlines()[0]}")
        return ServingOption(self.mesh, self.replicas, batch, plans)


def _larger(trial: _Trial, first: ServingOption, limit: int | None, max_batch: int) -> list[ServingOption]:
    """The options at the larger batches the memory allows, after ``first`` (`plan_serving`): the last one is the
    largest found. Memory is taken as a line in the rows, through the last two points planned (the weights at no
    rows to begin with); where the batch the line gives does not fit, `_fitting` shrinks it."""
    if limit is None:
        return [_fitting(trial, max_batch, first.batch)]
    points = [(0, first.plans.decode.memory["parameters"]), (first.batch, first.plans.peak_bytes)]
    found, least = [], first.batch
    for _ in range(_TRIES):
        (b0, m0), (b1, m1) = points[-2:]
        per_row = max(1.0, (m1 - m0) / (b1 - b0))
        wanted = min(max_batch, int(b1 + (limit - m1) / per_row))
        if wanted <= least:
            break
        option = _fitting(trial, wanted, least)
        found.append(option)
        if option.plans is None or option.batch < wanted:  # it had to shrink: the limit is reached
            break
        least = option.batch
        points.append((option.batch, option.plans.peak_bytes))
    return found


def _fitting(trial: _Trial, batch: int, least: int) -> ServingOption:
    """The option at ``batch`` rows, or at a tenth fewer while its plan does not fit (not below ``least + 1``)."""
    option = trial.option(batch)
    for _ in range(_TRIES - 1):
        if option.plans is not None or batch <= least + 1:
            break
        batch = max(least + 1, int(batch * _SHRINK))
        option = trial.option(batch)
    return option


def _choose(found, target: str, latency_s, batch_size: int) -> ServingOption:
    """The option ``target`` asks for among those that fit (within ``latency_s`` a token, where given); errors
    that name the way out where none does."""
    fits = [o for o in found if o.plans is not None]
    if not fits:
        raise MemoryLimitError("no way to serve fits the memory limit on any number of devices: "
                               + "; ".join(f"{o.devices} devices: {o.note}" for o in found)
                               + "; raise memory_limit, shorten max_length, or use a larger mesh")
    meets = [o for o in fits if latency_s is None or o.latency_s <= latency_s]
    if not meets:
        best = min(fits, key=lambda o: o.latency_s)
        raise PlanError(f"no option decodes a token within {latency_s * 1e3:.3f} ms: the fastest is "
                        f"{best.latency_s * 1e3:.3f} ms ({best.devices} devices, batch {best.batch}); raise "
                        "latency_s or plan for faster links")
    if target == "latency":
        return min((o for o in meets if o.batch == batch_size), key=lambda o: (o.latency_s, o.devices))
    return max(meets, key=lambda o: (o.tokens_per_s, -o.devices))


def parallelize_serving(model, serving: ServingPlan, rank: int | None = None, *, device_type: str = "cpu",
                        **options) -> tuple[int, RankDecoder]:
    """``(replica, this rank's decoder)``: the world (``replicas`` times the replica's devices, rank-major) cut
    into replicas, each running the chosen plans on its own sub-mesh; every rank of a replica takes the same
    prompts, and each replica serves its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    option = serving.chosen
    world = dist.get_world_size()
    if world != option.replicas * option.devices:
        raise PlanError(f"the serving plan runs {option.replicas} replicas of {option.devices} devices, but the "
                        f"process group has {world} ranks: launch {option.replicas * option.devices} processes")
    names = (_replica_axis(option.mesh), *option.mesh.names)
    device_mesh = init_device_mesh(device_type, (option.replicas, *option.mesh.shape), mesh_dim_names=names)
    replica = device_mesh.get_coordinate()[0]
    local = parallelize_decoding(model, option.plans, rank, device_mesh=device_mesh[option.mesh.names], **options)
    return replica, local


def _replica_axis(mesh: Mesh) -> str:
    """A name for the axis of replicas that none of ``mesh``'s axes has."""
    name = "replica"
    while name in mesh.names:
        name += "_"
    return name
