"""Turn one layout into another: the ordered collectives on each mesh axis, forward and backward.

Used by both the cost model and the lowering, so what is costed is exactly what
runs. Per axis the forward transitions and their autograd duals are:

    P -> R     all-reduce       backward: nothing
    P -> S(d)  reduce-scatter   backward: all-gather
    S(d) -> R  all-gather       backward: local slice if the gradient arriving is R,
                                          reduce-scatter if it is partial
    R -> S(d)  local slice      backward: all-gather
    S(d) -> S(e)  all-gather then slice (costed as such)
    R consumed by split work    backward: all-reduce of the partial gradient (Megatron's f)

The gradient arriving is partial on an axis exactly when the consumer's strategy
takes the input R there while splitting its work (`Strategy.grad_allreduce_axes`).
When an all-gather on that axis comes right before, its backward becomes a
reduce-scatter (sequence parallelism's pairing); otherwise an f step is added.

A sum over several axes (``(P, P) -> (R, R)`` forward, or f steps on several
axes backward) runs one all-reduce per axis by default. `step_options` also
offers the hierarchical form, one per choice of the *outer* axis (the slow
one): reduce-scatter over a local dim on the other summed axes, all-reduce of
the 1/n piece on the outer axis, all-gather back. Forward it is three ordinary
steps, each with its own dual; backward (a gradient sum) it is one unit whose
forward is the identity (`step_units`), since its pieces change the
gradient's shape. When the summed axes are all the mesh's axes of size > 1,
the flat form is offered too: one all-reduce over every device (a `Step`
whose ``axes`` span several mesh axes). Which option runs is the cost model's choice
(`autotp.cost.reshard.cheapest_steps`); each step of a non-default form
carries the form's tag, so the plan records the choice and the lowering
replays it.

Axes are unsharded innermost first and sharded outermost first, so a dim split
on several axes keeps DTensor's nesting order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autotp.placement import Partial, Replicate, Shard, local_bytes, local_shape

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SLICE = "all_reduce", "all_gather", "reduce_scatter", "slice"
GRAD_ALL_REDUCE = "grad_all_reduce"
ALL_GATHER_RS = "all_gather_rs"  # all-gather whose incoming gradient is partial: backward reduce-scatter
# the pieces of a hierarchical gradient sum: identity forward, one collective backward (never lowered alone)
GRAD_REDUCE_SCATTER, GRAD_ALL_GATHER = "grad_reduce_scatter", "grad_all_gather"
GRAD_KINDS = (GRAD_ALL_REDUCE, GRAD_REDUCE_SCATTER, GRAD_ALL_GATHER)
_FORWARD = {ALL_REDUCE: ALL_REDUCE, ALL_GATHER: ALL_GATHER, ALL_GATHER_RS: ALL_GATHER,
            REDUCE_SCATTER: REDUCE_SCATTER, SLICE: None, GRAD_ALL_REDUCE: None,
            GRAD_REDUCE_SCATTER: None, GRAD_ALL_GATHER: None}
_BACKWARD = {ALL_REDUCE: None, ALL_GATHER: None, ALL_GATHER_RS: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER,
             SLICE: ALL_GATHER, GRAD_ALL_REDUCE: ALL_REDUCE,
             GRAD_REDUCE_SCATTER: REDUCE_SCATTER, GRAD_ALL_GATHER: ALL_GATHER}


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one mesh axis; a flat step spans several (``axes``).

    ``message_bytes`` follows nccl-tests: the all-reduce buffer, the gathered
    output of an all-gather, the full input of a reduce-scatter. ``form`` is
    the tag of the multi-axis reduction the step belongs to (`Reduction.tag`),
    empty for the default one-all-reduce-per-axis form.
    """

    kind: str
    axis: int
    dim: int | None
    message_bytes: int
    form: str = ""
    axes: tuple[int, ...] = ()  # a flat step: one collective over all of these axes' devices at once

    @property
    def span(self) -> tuple[int, ...]:
        """The mesh axes whose devices take part: ``axes`` for a flat step, else ``(axis,)``."""
        return self.axes or (self.axis,)

    @property
    def forward_kind(self) -> str | None:
        """The collective run in forward, or None (a local slice, or an f step)."""
        return _FORWARD[self.kind]

    @property
    def backward_kind(self) -> str | None:
        """The collective run in backward, or None."""
        return _BACKWARD[self.kind]


class Unsupported(Exception):
    """This transition is not offered (e.g. R -> P); the planner never chooses it."""


@dataclass(frozen=True)
class Reduction:
    """A sum over ``axes`` other than one all-reduce per axis.

    Hierarchical: reduce-scatter over local dim ``dim`` inside, all-reduce on
    ``outer``, all-gather back. Flat (``outer`` None): one all-reduce over all
    the devices of ``axes``. ``grad`` marks the backward sum of a partial
    gradient rather than a forward ``P -> R``.
    """

    axes: tuple[int, ...]
    outer: int | None = None
    dim: int | None = None
    grad: bool = False

    @property
    def tag(self) -> str:
        """A short stable name, recorded with the plan's collectives: ``hierarchical 0+1 outer 0 dim 0``."""
        axes = "+".join(str(a) for a in self.axes)
        form = f"flat {axes}" if self.outer is None else f"hierarchical {axes} outer {self.outer} dim {self.dim}"
        return f"{'grad ' if self.grad else ''}{form}"

    @property
    def inner(self) -> list[int]:
        """The reduce-scatter axes, innermost first."""
        return [a for a in sorted(self.axes, reverse=True) if a != self.outer]


def reduction_options(axes, shape, mesh_shape, grad: bool = False) -> list[Reduction]:
    """The other forms of a sum over ``axes`` of a local tensor of ``shape``: flat, then one per outer axis.

    Offered for two or more axes of size > 1. Flat when they are all the
    mesh's axes of size > 1 (its group is then every device). Hierarchical
    when some local dim splits evenly over the product of the inner axes (the
    first such dim, so dim 0 when it can: a reduce-scatter over dim 0 needs
    no copy).
    """
    axes = tuple(sorted(a for a in axes if mesh_shape[a] > 1))
    if len(axes) < 2:
        return []
    whole = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    options = [Reduction(axes, grad=grad)] if axes == whole else []
    for outer in axes:
        n = math.prod(mesh_shape[a] for a in axes if a != outer)
        dim = next((d for d, size in enumerate(shape) if size and size % n == 0), None)
        if dim is not None:
            options.append(Reduction(axes, outer, dim, grad))
    return options


def _hierarchical_steps(r: Reduction, nbytes: int, mesh_shape) -> list[Step]:
    """The steps of ``r`` on a local tensor of ``nbytes``, in forward order (a gradient sum runs them reversed)."""
    if r.outer is None:
        return [Step(GRAD_ALL_REDUCE if r.grad else ALL_REDUCE, r.axes[0], None, nbytes, r.tag, r.axes)]
    down, size = [], nbytes
    for a in r.inner:
        down.append((a, size))
        size //= mesh_shape[a]
    if r.grad:  # backward runs steps last to first: reduce-scatters, all-reduce, all-gathers
        return ([Step(GRAD_ALL_GATHER, a, r.dim, b, r.tag) for a, b in down]
                + [Step(GRAD_ALL_REDUCE, r.outer, None, size, r.tag)]
                + [Step(GRAD_REDUCE_SCATTER, a, r.dim, b, r.tag) for a, b in reversed(down)])
    return ([Step(REDUCE_SCATTER, a, r.dim, b, r.tag) for a, b in down]
            + [Step(ALL_REDUCE, r.outer, None, size, r.tag)]
            + [Step(ALL_GATHER, a, r.dim, b, r.tag) for a, b in reversed(down)])


def summed_axes(src, dst) -> tuple[int, ...]:
    """Axes on which the forward sums a partial tensor into a replicated one (``P -> R``)."""
    return tuple(a for a, (s, d) in enumerate(zip(src, dst)) if isinstance(s, Partial) and isinstance(d, Replicate))


def _dims_split(layout, dim):
    return [a for a, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]


def _axes_to_clear(src, dst) -> set[int]:
    """Axes whose placement must be undone first, including inner axes nested under them."""
    clear = {a for a in range(len(src)) if src[a] != dst[a] and not isinstance(src[a], Replicate)}
    changed = True
    while changed:
        changed = False
        for a in range(len(src)):
            touched = {p.dim for p in (src[a], dst[a]) if isinstance(p, Shard)}
            if src[a] == dst[a] and a not in clear:
                continue
            for b in range(a + 1, len(src)):
                if b not in clear and isinstance(src[b], Shard) and src[b].dim in touched:
                    clear.add(b)
                    changed = True
    return clear


def plan_steps(src, dst, meta, mesh_shape, grad_axes=(), reduction: Reduction | None = None,
               grad_reduction: Reduction | None = None, measure=local_bytes) -> list[Step]:
    """The steps that turn layout ``src`` into ``dst`` for a tensor of ``meta``.

    ``grad_axes`` are the axes on which the consumer hands back a partial
    gradient; each is served by the last all-gather on that axis or by an f step.
    ``reduction`` runs the forward sum (`summed_axes`) in hierarchical form,
    first; ``grad_reduction`` does the same for the f steps. Both must be among
    `step_options`' forms; None is one all-reduce per axis. ``measure(meta, layout, mesh_shape)`` gives a
    layout's local bytes (`_Recipe` records them instead, for `step_options`).
    """
    steps = _layout_steps(src, dst, meta, mesh_shape, reduction, measure)
    steps, rest = _serve_grad_axes(steps, grad_axes)
    nbytes = measure(meta, dst, mesh_shape)
    if grad_reduction is None:
        return steps + [Step(GRAD_ALL_REDUCE, axis, None, nbytes) for axis in rest]
    if grad_reduction not in reduction_options(rest, local_shape(meta.shape, dst, mesh_shape), mesh_shape, True):
        raise Unsupported(f"{grad_reduction.tag} is not a form of the gradient sum over axes {rest}")
    return steps + _hierarchical_steps(grad_reduction, nbytes, mesh_shape)


def step_options(src, dst, meta, mesh_shape, grad_axes=()) -> list[list[Step]]:
    """Every way `plan_steps` offers to turn ``src`` into ``dst``, one all-reduce per axis first.

    The options depend on the tensor only through its bytes and through which of its local dims split evenly
    over which axes (`_shape_key`): they are worked out once per layouts and shape key, each step's bytes a
    recipe (`_Recipe`), and read for this tensor (costing Llama-2-70B at batch 8 asks 15,000 times, for 2,600
    keys).
    """
    _, entry = _recipes(src, dst, meta, mesh_shape, grad_axes)
    if isinstance(entry, str):
        raise Unsupported(entry)
    options, _ = entry
    local = {}
    return [[Step(s.kind, s.axis, s.dim, s.message_bytes.read(meta, mesh_shape, local), s.form, s.axes)
             for s in steps] for steps in options]


def options_key(src, dst, meta, mesh_shape, grad_axes=()) -> tuple:
    """A key equal for two tensors exactly when `step_options` gives them equal steps (or raises for both):
    the layouts, the shape key (`_shape_key`) and the local bytes of each layout the steps' bytes are read
    from. Costing Llama-2-70B asks for 15,000 redistributions and meets some 8,500 keys
    (`autotp.cost.reshard.edge_cost` prices each once)."""
    key, entry = _recipes(src, dst, meta, mesh_shape, grad_axes)
    if isinstance(entry, str):
        return key
    return key, tuple(local_bytes(meta, layout, mesh_shape) for layout in entry[1])


# `step_options`' recipes and the layouts they read, by layouts and shape key: a pure function's results, kept for
# the life of the process
_OPTIONS: dict = {}


def _recipes(src, dst, meta, mesh_shape, grad_axes) -> tuple:
    """``(key, entry)``: `_OPTIONS`' key for this redistribution and its entry, worked out when first asked."""
    src, dst, grad_axes, mesh_shape = tuple(src), tuple(dst), tuple(grad_axes), tuple(mesh_shape)
    key = src, dst, grad_axes, mesh_shape, _shape_key(meta.shape, src, dst, mesh_shape, grad_axes)
    entry = _OPTIONS.get(key)
    if entry is None:
        entry = _OPTIONS[key] = _option_recipes(src, dst, meta, mesh_shape, grad_axes)
    return key, entry


def _option_recipes(src, dst, meta, mesh_shape, grad_axes) -> tuple[list[list[Step]], tuple] | str:
    """`step_options` with each step's bytes a `_Recipe`, and the layouts those read; or why there is none
    (`Unsupported`'s message)."""
    shape = local_shape(meta.shape, src, mesh_shape)
    options = []
    try:
        for reduction in [None] + reduction_options(summed_axes(src, dst), shape, mesh_shape):
            steps = _layout_steps(src, dst, meta, mesh_shape, reduction, _Recipe.of)
            _, rest = _serve_grad_axes(steps, grad_axes)
            grads = reduction_options(rest, local_shape(meta.shape, dst, mesh_shape), mesh_shape, grad=True)
            options += [plan_steps(src, dst, meta, mesh_shape, grad_axes, reduction, g, _Recipe.of)
                        for g in [None] + grads]
    except Unsupported as exc:
        return str(exc)
    layouts = tuple(dict.fromkeys(s.message_bytes.layout for steps in options for s in steps))
    return options, layouts


def _shape_key(shape, src, dst, mesh_shape, grad_axes) -> tuple:
    """What `step_options` reads of a tensor's shape beside its bytes: the local dim each form of a sum over
    several axes would split (`reduction_options`), forward over the axes ``src`` sums to ``dst`` and backward
    over any of ``grad_axes``; None where there is no such sum (most uses: the options then hold for any shape)."""
    return (_summed_dims(summed_axes(src, dst), shape, src, mesh_shape, False),
            _summed_dims(grad_axes, shape, dst, mesh_shape, True))


def _summed_dims(axes, shape, layout, mesh_shape, subsets: bool) -> tuple | None:
    """The first local dim of ``shape`` in ``layout`` that splits evenly over each product of the inner axes of a
    sum over ``axes`` (``subsets``: over any two or more of them), or None with fewer than two axes of size > 1."""
    axes = [a for a in axes if mesh_shape[a] > 1]
    if len(axes) < 2:
        return None
    sizes = [mesh_shape[a] for a in axes]
    products = _products(sizes) if subsets else [math.prod(sizes) // n for n in sizes]
    local = local_shape(shape, layout, mesh_shape)
    return tuple(next((d for d, size in enumerate(local) if size and size % n == 0), None) for n in products)


def _products(sizes) -> list[int]:
    """The products of every non-empty set of ``sizes``."""
    products = {1}
    for n in sizes:
        products |= {p * n for p in products}
    return sorted(products - {1})


class _Recipe:
    """A step's bytes as `_layout_steps`, `plan_steps` and `_hierarchical_steps` compute them from a layout: its
    local bytes, times ``mult``, then floor-divided by each of ``divs`` in turn. `read` gives, for any tensor,
    the number they would have computed."""

    __slots__ = ("layout", "mult", "divs")

    def __init__(self, layout: tuple, mult: int = 1, divs: tuple = ()):
        self.layout, self.mult, self.divs = layout, mult, divs

    @classmethod
    def of(cls, meta, layout, mesh_shape) -> "_Recipe":
        """In the place of `local_bytes` (``measure``)."""
        return cls(tuple(layout))

    def __mul__(self, n: int) -> "_Recipe":
        if self.divs:
            raise TypeError("a recipe multiplies before it divides")
        return _Recipe(self.layout, self.mult * n)

    def __floordiv__(self, n: int) -> "_Recipe":
        return _Recipe(self.layout, self.mult, self.divs + (n,))

    def read(self, meta, mesh_shape, local: dict) -> int:
        """The bytes for ``meta``; ``local``: each layout's local bytes read so far, for this tensor."""
        nbytes = local.get(self.layout)
        if nbytes is None:
            nbytes = local[self.layout] = local_bytes(meta, self.layout, mesh_shape)
        nbytes *= self.mult
        for n in self.divs:
            nbytes //= n
        return nbytes


def live_steps(steps, mesh_shape) -> list[Step]:
    """The steps that move data: those over more than one device (a step on an axis of size 1 is a no-op)."""
    return [s for s in steps if math.prod(mesh_shape[a] for a in s.span) > 1]


def is_gradient_sum(steps, mesh_shape) -> bool:
    """Whether ``steps`` only sum a gradient (f steps, in any form): nothing forward, one reduction backward.

    On a parameter's only edge this is data parallelism's gradient reduction,
    the one DDP buckets and overlaps with the backward pass; the cost model
    (`autotp.cost.reshard`) and the lowering (`autotp.lower.reducer`) both ask this.
    """
    real = live_steps(steps, mesh_shape)
    return bool(real) and all(s.kind in GRAD_KINDS for s in real)


def gathers(steps, mesh_shape) -> bool:
    """Whether ``steps`` all-gather a split (``S(d) -> R``): the use then holds a buffer of its own.

    The all-gather inside a hierarchical sum's form is not one: a sum's
    result takes the place of the partial sum it reduces.
    """
    return any(s.forward_kind == ALL_GATHER and not s.form and mesh_shape[s.axis] > 1 for s in steps)


def step_units(steps) -> list[list[Step]]:
    """The steps grouped as the lowering runs them: one module per step, one per hierarchical gradient sum."""
    units = []
    for s in steps:
        if s.form and s.kind in GRAD_KINDS and units and units[-1][-1].form == s.form:
            units[-1].append(s)
        else:
            units.append([s])
    return units


def _serve_grad_axes(steps, grad_axes) -> tuple[list[Step], list[int]]:
    """Turn the last all-gather on each gradient axis into an all-gather/reduce-scatter pair; the rest need f."""
    steps, rest = list(steps), []
    for axis in grad_axes:
        last = [i for i, s in enumerate(steps) if axis in s.span]
        if last and steps[last[-1]].kind == ALL_GATHER:
            steps[last[-1]] = replace(steps[last[-1]], kind=ALL_GATHER_RS)
        else:
            rest.append(axis)
    return steps, rest


def _layout_steps(src, dst, meta, mesh_shape, reduction: Reduction | None = None,
                  measure=local_bytes) -> list[Step]:
    if any(isinstance(d, Partial) and not isinstance(s, Partial) for s, d in zip(src, dst)):
        raise Unsupported(f"cannot produce a partial sum from {src}")
    cur, steps, done = list(src), [], set()
    if reduction is not None:  # the sum first, while every local piece is whole
        shape = local_shape(meta.shape, src, mesh_shape)
        if reduction not in reduction_options(summed_axes(src, dst), shape, mesh_shape):
            raise Unsupported(f"{reduction.tag} is not a form of the sum from {src} to {dst}")
        steps = _hierarchical_steps(reduction, measure(meta, src, mesh_shape), mesh_shape)
        for a in reduction.axes:
            cur[a] = Replicate()
        done = set(reduction.axes)
    for a in sorted(_axes_to_clear(src, dst) - done, reverse=True):
        n = mesh_shape[a]
        piece_bytes = measure(meta, cur, mesh_shape)
        if isinstance(cur[a], Shard):
            steps.append(Step(ALL_GATHER, a, cur[a].dim, piece_bytes * n))
        elif isinstance(dst[a], Shard) and not any(
                b != a and dst[a].dim in (getattr(cur[b], "dim", None), getattr(dst[b], "dim", None))
                for b in range(len(cur))):
            steps.append(Step(REDUCE_SCATTER, a, dst[a].dim, piece_bytes))
            cur[a] = dst[a]
            continue
        else:
            steps.append(Step(ALL_REDUCE, a, None, piece_bytes))
        cur[a] = Replicate()
    for a in range(len(cur)):
        if cur[a] != dst[a]:
            steps.append(Step(SLICE, a, dst[a].dim, measure(meta, cur, mesh_shape)))
            cur[a] = dst[a]
    return steps


def entry_layout(src, targets, meta, mesh_shape):
    """The most split layout a tensor made in ``src`` may arrive in, with every target reached by local slices.

    For a program input: where every use splits it along the same dim of an
    axis (a batch split over a data-parallel axis), each rank may be handed
    just its own piece, as ``DistributedSampler`` hands each DDP rank its own
    rows; an axis where some use needs more keeps ``src``'s placement.
    """
    layout = []
    for a, placement in enumerate(src):
        on_axis = {t[a] for t in targets}
        only = next(iter(on_axis)) if len(on_axis) == 1 else None
        layout.append(only if isinstance(only, Shard) and isinstance(placement, Replicate) else placement)
    layout = tuple(layout)
    try:
        hops = [(src, layout)] + [(layout, t) for t in targets]
        local = all(s.kind == SLICE for a, b in hops for s in _layout_steps(a, b, meta, mesh_shape))
    except Unsupported:
        local = False
    return layout if local else tuple(src)


def replay_steps(src, dst, meta, mesh_shape, grad_axes=(), forms=frozenset()) -> list[Step]:
    """The option of `step_options` whose hierarchical forms are exactly ``forms`` (the tags a plan recorded).

    This is how the lowering runs the form the cost model chose without
    knowing the profile. Raises `Unsupported` when no option matches.
    """
    for steps in step_options(src, dst, meta, mesh_shape, grad_axes):
        if {s.form for s in steps if s.form} == set(forms):
            return steps
    raise Unsupported(f"no redistribution from {src} to {dst} has the forms {sorted(forms)}")
