"""Lower a plan: rewrite the captured GraphModule into this rank's program.

Four edits, all visible in ``print(local.code)``:

1. every parameter is replaced by this rank's shard (the chunk DTensor's
   ``Shard(d)`` would hold; the full tensor for ``R``), on a ``DeviceMesh``
   an ``nn.Parameter(DTensor)`` read through ``to_local`` (`autotp.lower.dtensor`);
2. each input may arrive whole or as this rank's piece of its ``plan.io``
   layout (a data-parallel rank's own rows); a whole one is cut there;
3. before each op, each tensor input is redistributed from its producer's
   layout to the layout the op's strategy needs (`redistribute.plan_steps`),
   and a replicated input consumed by split work gets a gradient all-reduce,
   except a parameter's data-parallel gradient sum, which the gradient
   reducer runs in buckets behind the backward pass (`autotp.lower.reducer`);
4. shape arguments of views and expands are rewritten to local sizes.

Outputs come back as ``plan.io["outputs"]`` says: each rank its own rows
where the plan splits the batch, whole otherwise (and always with
``whole_outputs``).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autotp.errors import PlanError
from autotp.graph.opgraph import KIND_PARAM, TensorMeta, build_opgraph, meta_of, tensor_input_nodes
from autotp.graph.random import draws_whole
from autotp.lower.batching import batch_collectives
from autotp.lower.collective_matmul import fuse_collective_matmuls
from autotp.lower.collectives import AxisComm, Collective, CollectiveChain
from autotp.lower.dtensor import as_dtensor_parameter, read_parameters_locally
from autotp.lower.entry import InputEntry
from autotp.lower.impls import build_impl
from autotp.lower.local_args import local_target, localize_args
from autotp.lower.pending import wait_at_first_use
from autotp.lower.random_ops import whole_draw
from autotp.lower.recompute import recompute_layers
from autotp.lower.regather import install_regather_hooks
from autotp.lower.reducer import GRADIENT_SLICE, GradientReducer
from autotp.placement import Partial, R, cut_piece, local_shape, parse_layout, shard_cuts
from autotp.redistribute import ALL_GATHER, SLICE, Unsupported, gathers, is_gradient_sum, replay_steps, step_units
from autotp.solve.problem import OUTPUT, deferred_parameters, split_gradient_axes, use_target, uses_of
from autotp.solve.regather import regather_kind
from autotp.strategies.base import Strategy


def shard_tensor(full: torch.Tensor, layout, mesh_shape, coords) -> torch.Tensor:
    """This device's piece of ``full`` under ``layout`` (a copy, so only the shard stays alive)."""
    return cut_piece(full, shard_cuts(layout, mesh_shape, coords)).detach().clone()


def set_module_tensor(module: torch.nn.Module, fqn: str, value: torch.Tensor) -> None:
    """Put ``value`` where ``fqn`` names a parameter or buffer of ``module`` (it stays one or the other)."""
    owner_name, _, leaf = fqn.rpartition(".")
    setattr(module.get_submodule(owner_name) if owner_name else module, leaf, value)


def parameter_aliases(module: torch.nn.Module) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Each distinct parameter with every name it is reachable by (tied weights have several)."""
    groups: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), ([], param))[0].append(name)
    return list(groups.values())


class _Lowerer:
    def __init__(self, gm: fx.GraphModule, plan, coords, groups, graph):
        self.gm, self.plan, self.mesh, self.coords, self.graph = gm, plan, plan.mesh, coords, graph
        self.comms = [AxisComm(name, size, coords[a], (groups or {}).get(a))
                      for a, (name, size) in enumerate(zip(self.mesh.names, self.mesh.shape))]
        self.groups = groups
        self.modules: dict[tuple, str] = {}
        self.shared: dict[tuple, fx.Node] = {}
        self.position = {name: i for i, name in enumerate(graph.order)}
        overlap = plan.training and plan.runtime["overlap_gradients"]
        self.deferred = deferred_parameters(graph, uses_of(graph)) if overlap else set()
        # parameter node -> the axes its gradient is reduce-scattered over, into its optimizer slices (ZeRO-2)
        self.gradient_split = {op.name: tuple(self.mesh.names.index(a) for a in plan.optimizer_sharding[op.fqn])
                               for op in graph.nodes() if op.kind == KIND_PARAM and op.fqn in plan.gradient_sharding}
        self.reducer = GradientReducer(plan.runtime["bucket_bytes"]) if overlap else None
        self.entries: dict[str, tuple[fx.Node, tuple]] = {}  # placeholder -> (its entry node, the layout after it)
        self.forms: dict[tuple, set] = {}  # (consumer, input, producer) -> multi-axis forms the plan chose
        for c in plan.collectives:
            if c.get("form"):
                self.forms.setdefault((c["node"], c["input"], c["producer"]), set()).add(c["form"])

    def collective(self, kind: str, axis: int, dim, span=(), regather: bool = False) -> str:
        key = (kind, axis, dim, tuple(span), regather)
        if key not in self.modules:
            comm = self.span_comm(tuple(span)) if len(span) > 1 else self.comms[axis]
            name = f"{kind}_{comm.name}" + (f"_d{dim}" if dim is not None else "") + ("_regather" if regather else "")
            self.gm.add_submodule(name, Collective(kind, comm, dim, regather))
            self.modules[key] = name
        return self.modules[key]

    def span_comm(self, axes: tuple) -> AxisComm:
        """Every device of several mesh axes as one group (``dp_tp``), for a flat sum.

        Flat sums are offered only over all the mesh's axes of size > 1, so the
        group is the whole mesh: ``groups[axes]`` if the caller gave one, else
        the default group, which must then hold exactly the mesh's devices.
        """
        group = None
        if self.groups is not None:
            group = self.groups.get(axes)
            if group is None:
                import torch.distributed as dist

                if dist.get_world_size() != self.mesh.size:
                    raise PlanError(f"the plan sums over every device of {self.mesh} at once, but the default process "
                                    f"group has {dist.get_world_size()} ranks: pass groups[{axes}] or re-plan")
                group = dist.group.WORLD
        return AxisComm("_".join(self.mesh.names[a] for a in axes), math.prod(self.mesh.shape[a] for a in axes),
                        self.mesh.rank_of(self.coords), group, counter=self.comms[0].counter)

    def axes_comm(self, axes: tuple) -> AxisComm:
        """The group of one mesh axis, or of all of them (`span_comm`)."""
        return self.comms[axes[0]] if len(axes) == 1 else self.span_comm(axes)

    def chain(self, unit) -> str:
        """The module of a hierarchical gradient sum, e.g. ``grad_hierarchical_dp_tp_d0`` (outer axis first)."""
        key = tuple((s.kind, s.axis, s.dim) for s in unit)
        if key not in self.modules:
            axes = dict.fromkeys(self.mesh.names[s.axis] for s in sorted(unit, key=lambda s: s.dim is not None))
            name = f"grad_hierarchical_{'_'.join(axes)}_d{unit[0].dim}"
            self.gm.add_submodule(name, CollectiveChain([(s.kind, self.comms[s.axis], s.dim) for s in unit]))
            self.modules[key] = name
        return self.modules[key]

    def redistribute(self, node: fx.Node, src, dst, grad: bool, grad_axes=(), consumer=("output", 0),
                     producer: str | None = None, split: tuple = (), regather: bool = False) -> fx.Node:
        """Insert the steps from ``src`` to ``dst`` (and the gradient all-reduces) before the current point.

        Uses that need the same tensor in the same layout (a gradient flowing
        back or not, summed over the same axes: `autotp.solve.problem.use_target`)
        share one copy: one all-gather forward, and one reduction of their
        summed partial gradients, as the cost model counts them. A sum over
        several axes takes the form the plan recorded for this edge
        (``consumer`` is the consuming node and input index; ``producer`` the
        plan's producer, when ``node`` stands for it: an input's entry cut).
        A deferred parameter's gradient sum goes to the gradient reducer
        instead of the graph, and so does a ZeRO-2 parameter's, which ends in
        a reduce-scatter over ``split`` into its optimizer slices. With
        ``regather`` the first all-gather keeps its input for backward to
        gather again (`autotp.lower.regather`) instead of what it returns.
        """
        producer = producer or node.name
        meta = meta_of(node.meta["val"])
        key = (producer, tuple(src), tuple(dst), grad, tuple(grad_axes), split)
        if key not in self.shared:
            forms = self.forms.get((*consumer, producer), set())
            try:
                steps = replay_steps(src, dst, meta, self.mesh.shape, grad_axes, forms)
            except Unsupported as exc:
                raise PlanError(f"the plan's collectives for {producer!r} -> {consumer[0]!r} do not fit this "
                                f"model ({exc}): the plan was edited or made for another model; re-plan") from None
            if producer in self.deferred and (split or is_gradient_sum(steps, self.mesh.shape)):
                self.defer(node, steps, consumer[0], split)
                self.shared[key] = node
                return node
            out, again = node, regather and gathers(steps, self.mesh.shape)
            for unit in step_units([s for s in steps if self.mesh.shape[s.axis] > 1]):
                s = unit[0]
                first = again and s.forward_kind == ALL_GATHER and not s.form
                again = again and not first
                module = (self.collective(s.kind, s.axis, s.dim, s.span, first) if len(unit) == 1
                          else self.chain(unit))
                out = self._call(module, out)
            self.shared[key] = out
        return self.shared[key]

    def use(self, node: fx.Node, consumer: str, i: int, strategy=None) -> fx.Node:
        """``node`` redistributed for input ``i`` of ``consumer`` (or for the program's output)."""
        src, fed = self.plan.nodes[node.name].out_layout(), node
        if node.op == "placeholder":
            fed, src = self.entry(node)
        _, dst, grad, axes = use_target(self.graph, self.mesh, self.plan.training, self.plan.runtime["whole_outputs"],
                                        node.name, consumer, i, src, strategy)
        split = self.gradient_split.get(node.name, ())
        summed = split_gradient_axes(split, src, dst, grad, axes)
        if summed is None or (split and node.name not in self.deferred):
            raise PlanError(f"the plan reduce-scatters the gradient of {node.name!r} into its optimizer slices, but "
                            f"its use by {consumer!r} cannot (the plan was edited or made for another model); re-plan")
        regather = self.plan.training and regather_kind(self.graph.node(node.name)) in self.plan.regather
        return self.redistribute(fed, src, dst, grad, summed, ("output", 0) if consumer == OUTPUT else (consumer, i),
                                 producer=node.name, split=split, regather=regather and consumer != OUTPUT)

    def defer(self, node: fx.Node, steps, consumer: str, split: tuple = ()) -> None:
        """Hand a parameter's gradient sum to the reducer: its steps' backward collectives, in the order they run.

        A ZeRO-2 parameter's sum ends in a reduce-scatter over ``split``
        that leaves each device its optimizer slice of the summed gradient.
        """
        unit = tuple((s.backward_kind, self.span_comm(s.span) if len(s.span) > 1 else self.comms[s.axis])
                     for s in reversed(steps) if s.backward_kind and math.prod(self.mesh.shape[a] for a in s.span) > 1)
        if split:
            unit += ((GRADIENT_SLICE, self.axes_comm(split)),)
        self.reducer.add(self.gm.get_parameter(node.target), unit, self.position[consumer])

    def entry(self, node: fx.Node) -> tuple[fx.Node, tuple]:
        """A program input as its uses see it: the node after the input's entry cut, and its layout."""
        if node.name not in self.entries:
            given = dict((name, layout) for name, layout in self.plan.io.get("inputs", []))
            layout = parse_layout(given.get(node.name, ("R",) * self.mesh.ndim))
            meta = meta_of(node.meta["val"])
            out = node
            if any(p != R for p in layout) and isinstance(meta, TensorMeta):
                steps = [s for s in replay_steps((R,) * self.mesh.ndim, layout, meta, self.mesh.shape)
                         if s.kind == SLICE and self.mesh.shape[s.axis] > 1]
                name = f"input_{node.name}"
                self.gm.add_submodule(name, InputEntry(node.name, meta.shape, local_shape(meta.shape, layout,
                                                                                          self.mesh.shape),
                                                       [Collective(SLICE, self.comms[s.axis], s.dim) for s in steps]))
                with self.gm.graph.inserting_after(node):
                    out = self._call(name, node)
            self.entries[node.name] = (out, layout)
        return self.entries[node.name]

    def _call(self, module: str, arg: fx.Node) -> fx.Node:
        new = self.gm.graph.call_module(module, (arg,))
        new.meta["val"] = arg.meta.get("val")
        return new


def _shard_buffers(gm: fx.GraphModule, plan, coords) -> None:
    """Keep this rank's piece of each buffer the plan splits (``plan.buffers``: a key/value cache by kv-head).

    Such a buffer is state the program writes in place, taken as it is laid
    out (`autotp.strategies.inplace`), so each rank holds and updates its piece
    between calls; every other buffer stays whole.
    """
    for fqn, layout in plan.buffers.items():
        try:
            whole = gm.get_buffer(fqn)
        except AttributeError:
            raise PlanError(f"the plan splits buffer {fqn!r}, which the model does not have: "
                            "re-plan this model") from None
        set_module_tensor(gm, fqn, shard_tensor(whole, parse_layout(layout), plan.mesh.shape, coords))


def _node_plan(plan, node: fx.Node):
    entry = plan.nodes.get(node.name)
    if entry is None:
        raise PlanError(f"the plan has no entry for node {node.name!r} ({node.target}): the plan was made for "
                        "a different model or inputs; re-plan with autotp.plan")
    return entry


def _rewrite_inputs(low: _Lowerer, node: fx.Node, entry) -> None:
    inputs = [n for n in tensor_input_nodes(node) if n.name in low.plan.nodes]
    layouts = entry.in_layouts()
    if len(layouts) != len(inputs):
        raise PlanError(f"node {node.name!r} has {len(inputs)} tensor inputs but the plan gives {len(layouts)}")
    if node.target is operator.getitem:
        return  # pieces of a split keep the split's layout
    strategy = Strategy(out=entry.out_layout(), ins=layouts)
    replaced = {}
    with low.gm.graph.inserting_before(node):
        for i, inp in enumerate(inputs):
            replaced[i] = low.use(inp, node.name, i, strategy)
    counter = iter(range(len(inputs)))

    def swap(a):
        if isinstance(a, fx.Node) and a.name in low.plan.nodes:
            return replaced.get(next(counter), a)
        return a

    node.args, node.kwargs = pytree.tree_map(swap, (node.args, dict(node.kwargs)))
    if entry.impl:
        _use_impl(low, node, entry, inputs)
        return
    if draws_whole(node.target, node.args, node.kwargs, entry.out_layout(), low.mesh.shape):
        module = whole_draw(node.target, node.args, dict(node.kwargs), [n.meta["val"] for n in inputs],
                            entry.out_layout(), low.mesh.shape, low.coords)
        _call_module(low, node, f"whole_draw_{node.name}", module)
        return
    meta = meta_of(node.meta["val"])
    if isinstance(meta, TensorMeta):
        node.args = localize_args(node.target, node.args, local_shape(meta.shape, entry.out_layout(), low.mesh.shape))
    node.target = local_target(node.target)


def check_plan_fits(graph, plan) -> None:
    """The plan must name exactly this graph's nodes and ops; else it was made for another model."""
    ours = {op.name: op.op_name for op in graph.nodes()}
    theirs = {name: entry.op for name, entry in plan.nodes.items()}
    if ours == theirs:
        return
    missing = sorted(ours.keys() - theirs.keys())[:3]
    extra = sorted(theirs.keys() - ours.keys())[:3]
    changed = sorted(n for n in ours.keys() & theirs.keys() if ours[n] != theirs[n])[:3]
    raise PlanError(f"the plan does not fit this model (nodes not in the plan: {missing}, plan nodes not in the "
                    f"model: {extra}, different ops: {changed}): it was made for a different model or inputs; "
                    "re-plan with autotp.plan")


def _use_impl(low: _Lowerer, node: fx.Node, entry, inputs) -> None:
    """Replace the op by the module that implements its strategy on this device."""
    shapes = [tuple(meta_of(n.meta["val"]).shape) for n in inputs]
    module = build_impl(entry.impl, node.target, node.args, dict(node.kwargs), entry.in_layouts(), shapes,
                        low.coords, low.mesh.shape, low.comms)
    _call_module(low, node, f"{entry.impl}_{node.name}", module)


def _call_module(low: _Lowerer, node: fx.Node, name: str, module) -> None:
    """Make ``node`` a call of ``module`` (added as ``name``) on its tensor arguments, in order."""
    low.gm.add_submodule(name, module)
    node.op, node.target = "call_module", name
    node.args, node.kwargs = tuple(a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node)), {}


def lower(gm: fx.GraphModule, plan, rank: int, groups=None, *, graph=None, batch: bool = False,
          overlap: bool = False, counter=None, load_shard=None, device_mesh=None) -> fx.GraphModule:
    """Rewrite ``gm`` in place into the program of ``rank``; ``groups`` maps mesh axis -> process group.

    Without ``groups`` the result can be printed and inspected but not run.
    ``graph`` is ``gm``'s `OpGraph` with the inputs' ``requires_grad`` (built
    here, with none, if not given). ``batch`` merges independent collectives
    and ``overlap`` starts them early and waits late (`autotp.lower.batching`;
    both off by default, as the cost model prices the program: each collective
    where it is used, the gradient sums in the reducer's buckets);
    ``counter`` (a `CommCounter`) records every collective the module issues.
    ``load_shard(name, param, layout, coords)`` supplies each parameter's
    shard (from a checkpoint, see `autotp.materialize`) instead of cutting it
    out of the full ``param``. With ``device_mesh`` (the torch ``DeviceMesh``
    ``groups`` come from) each parameter is an ``nn.Parameter(DTensor)`` on it
    that the program reads through ``to_local`` (`autotp.lower.dtensor`);
    without, a plain ``nn.Parameter`` of the shard.
    """
    graph = graph if graph is not None else build_opgraph(gm)
    check_plan_fits(graph, plan)
    coords = plan.mesh.coords(rank)
    low = _Lowerer(gm, plan, coords, groups, graph)
    for comm in low.comms:
        comm.counter = counter
    optimizer_shards = []  # (parameter, the group its optimizer state is split over): ZeRO-1 and 2
    for names, param in parameter_aliases(gm):
        planned = [n for n in names if n in plan.parameters]
        if not planned:
            raise PlanError(f"parameter {names[0]!r} is not in the plan: re-plan this model")
        layout = parse_layout(plan.parameters[planned[0]])
        shard = (load_shard(planned[0], param, layout, coords) if load_shard is not None
                 else shard_tensor(param, layout, plan.mesh.shape, coords))
        local = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
        if device_mesh is not None:
            local = as_dtensor_parameter(local, layout, device_mesh, plan.mesh.shape)
        for name in names:  # tied weights stay one parameter
            set_module_tensor(gm, name, local)
        axes = plan.optimizer_sharding.get(planned[0])
        if axes and param.requires_grad:
            optimizer_shards.append((local, low.axes_comm(tuple(plan.mesh.names.index(a) for a in axes))))
    _shard_buffers(gm, plan, coords)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.name in plan.nodes:
            _rewrite_inputs(low, node, _node_plan(plan, node))
        elif node.op == "output":
            with gm.graph.inserting_before(node):
                node.args = pytree.tree_map(
                    lambda a: low.use(a, OUTPUT, 0) if isinstance(a, fx.Node) and a.name in plan.nodes else a,
                    node.args)
    gm.graph.lint()
    gm.recompile()
    if plan.runtime.get("overlap_tp", False):
        fuse_collective_matmuls(gm, {name for name, entry in plan.nodes.items()
                                     if any(isinstance(p, Partial) for p in entry.out_layout())})
    batch_collectives(gm, batch, overlap)
    recompute_layers(gm, graph, plan.recompute if plan.training else ())
    if plan.training and plan.regather:
        install_regather_hooks(gm)
    read_parameters_locally(gm)
    prefetch = plan.training and plan.runtime["overlap_gradients"]
    if prefetch and optimizer_shards:  # the all-gathers after the optimizer step land just before first use
        first = wait_at_first_use(gm, [p for p, _ in optimizer_shards])
        optimizer_shards.sort(key=lambda entry: first.get(id(entry[0]), math.inf))
        gm.graph.lint()
        gm.recompile()
    if low.reducer is not None:
        low.reducer.hook()
    gm.autotp_reducer = low.reducer  # None when the plan runs its gradient sums in the graph
    gm.autotp_optimizer_shards = optimizer_shards  # read by `autotp.runtime.shard_optimizer`, in first-use order
    gm.autotp_prefetch = prefetch  # the forward pass waits for ZeRO's all-gathers itself (`autotp.lower.pending`)
    return gm
