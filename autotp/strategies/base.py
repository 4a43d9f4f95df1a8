"""Strategy types: how one op may be split, on one mesh axis and on the whole mesh.

A rule is written for one mesh axis and returns `AxisOption`s: the output
placement and the placement each tensor input must arrive in. `expand` turns
per-axis options into whole-mesh `Strategy`s mechanically, the way DTensor
expands its single-axis rules:

    linear on a 2-axis mesh, per-axis options {R, col, row}
    -> 9 strategies, e.g. out (S(0), S(2)) = batch split on axis 0, column split on axis 1,
    minus those whose local shapes do not divide evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable

from autotp.placement import P, R, Partial, Replicate, Shard, divides


@dataclass(frozen=True)
class AxisOption:
    """One way to split an op on one mesh axis: ``ins`` arrive as given, ``out`` results.

    ``impl`` names a local implementation other than the op itself (see
    ``autotp.lower.impls``), e.g. a vocabulary-parallel embedding that masks the
    rows another device holds. ``inner_all_reduces`` counts the all-reduces
    such an implementation runs on this axis, of one value per row, or of
    ``inner_values`` values in all when that is set.
    """

    out: object
    ins: tuple
    impl: str | None = None
    inner_all_reduces: int = 0
    inner_values: int | None = None


@dataclass(frozen=True)
class Strategy:
    """One way to split an op on the whole mesh: per-axis layouts of its output and inputs."""

    out: tuple
    ins: tuple  # one layout (tuple over mesh axes) per tensor input
    impl: str | None = None  # a special local implementation (see AxisOption)
    inner_all_reduces: tuple = ()  # per mesh axis, all-reduces run inside the implementation
    inner_values: int | None = None  # each of them moves one value per local row, or this many values
    # a parameter's optimizer state split over these mesh axes, where the parameter itself is whole (ZeRO-1):
    # each device steps its slice and the updated parameter is all-gathered (`autotp.runtime.optimizer`)
    optimizer_axes: tuple = ()
    # ZeRO-2: the gradient is reduce-scattered straight into the optimizer state's slice, so each device keeps
    # only its 1/n of it (`autotp.lower.reducer`); needs a parameter with one use, taken as it is laid out
    gradient_split: bool = False

    def grad_allreduce_axes(self, i: int) -> tuple[int, ...]:
        """Mesh axes on which input ``i``'s local gradient is a partial sum although the input is R.

        This is Megatron's *f*: a replicated tensor consumed by split work gets
        a partial gradient, which must be all-reduced in backward. It happens
        exactly where the input is R and the output is not (S or P).
        """
        return tuple(a for a, (p_in, p_out) in enumerate(zip(self.ins[i], self.out))
                     if isinstance(p_in, Replicate) and not isinstance(p_out, Replicate))

    @property
    def gradient_slice_axes(self) -> tuple:
        """The axes the gradient is reduce-scattered over into the optimizer's slices (ZeRO-2), else ``()``."""
        return self.optimizer_axes if self.gradient_split else ()

    @property
    def is_replicated(self) -> bool:
        """Everything whole, the optimizer state included: the single-device program."""
        return not self.optimizer_axes and all(isinstance(p, Replicate) for p in self.out) and all(
            isinstance(p, Replicate) for layout in self.ins for p in layout)

    def describe(self) -> str:
        ins = ", ".join("".join(str(p) for p in layout) for layout in self.ins)
        impl = f" [{self.impl}]" if self.impl else ""
        if self.optimizer_axes:
            what = "optimizer state and gradient" if self.gradient_split else "optimizer state"
            impl += f" [{what} split on axes {','.join(str(a) for a in self.optimizer_axes)}]"
        return f"({ins}) -> {''.join(str(p) for p in self.out)}{impl}"


Rule = Callable[[object], list]  # OpNode -> list[AxisOption]


@dataclass(frozen=True)
class RuleEntry:
    """A registered rule."""

    fn: Rule


def replicate_option(n_inputs: int) -> AxisOption:
    return AxisOption(R, (R,) * n_inputs)


def expand(op, options: list, mesh_shape) -> list[Strategy]:
    """All combinations of per-axis options whose local shapes split evenly, without repeats."""
    options = [replicate_option(len(op.inputs))] + [o for o in options if o != replicate_option(len(op.inputs))]
    seen, out = set(), []
    for combo in product(options, repeat=len(mesh_shape)):
        impls = {o.impl for o in combo} - {None}
        if len(impls) > 1:
            continue
        s = Strategy(out=tuple(o.out for o in combo),
                     ins=tuple(tuple(o.ins[i] for o in combo) for i in range(len(op.inputs))),
                     impl=next(iter(impls), None), inner_all_reduces=tuple(o.inner_all_reduces for o in combo),
                     inner_values=next((o.inner_values for o in combo if o.inner_values), None))
        if s in seen or not _fits(op, s, mesh_shape):
            continue
        seen.add(s)
        out.append(s)
    return out


def _fits(op, s: Strategy, mesh_shape) -> bool:
    """Even splits only, and partial sums only of floating-point tensors."""
    pairs = [(m, s.out) for m in op.out] + list(zip(op.in_metas, s.ins))
    for meta, layout in pairs:
        if not divides(meta.shape, layout, mesh_shape):
            return False
        if not meta.is_float and any(isinstance(p, Partial) for p in layout):
            return False
    return True


def shard_or_r(meta, dim):
    """``S(dim)`` when ``dim`` is a real, non-broadcast dim of ``meta``; else ``R``."""
    if dim is None or dim < 0 or dim >= len(meta.shape) or meta.shape[dim] == 1:
        return R
    return Shard(dim)


__all__ = ["AxisOption", "Strategy", "RuleEntry", "expand", "shard_or_r", "P", "R", "Shard", "Partial"]
