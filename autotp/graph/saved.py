"""What each op's backward pass reads: found by running the op on the meta device under saved-tensor hooks.

The memory model counts as activations what autograd keeps between the
forward and the backward pass. Which tensors that is depends on the op:
``linear`` keeps its input and weight, ``add`` keeps nothing, ``rsqrt``
keeps its own output, ``silu`` its input, ``dropout`` a mask of its own.
Rather than a hand-written table that goes stale with every PyTorch
release, each distinct op (target, argument shapes, which inputs need a
gradient) runs once on meta tensors, which allocate nothing, inside
`torch.autograd.graph.saved_tensors_hooks`; each tensor autograd packs is
matched to an input or the output by storage (a saved view keeps its base
alive), and anything else it packs (a mask, a transposed copy) is counted
as extra bytes.

Two exceptions:

* the fused attention ops (``scaled_dot_product_attention``) take the math
  path on meta, which saves the whole attention matrix; on a device they
  run a fused kernel that keeps q, k, v, a mask or bias, the output and the
  log-sum-exp (``ATTENTION``), which is what is counted (a device that
  falls back to the math path keeps more);
* an op the meta device cannot run (data-dependent shapes, a custom op
  without a meta kernel) keeps every input and its output, the upper bound
  (the safe side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


@dataclass(frozen=True)
class Saved:
    """What an op's backward reads: some of its inputs (by position in ``OpNode.inputs``), its output, and
    ``extra`` bytes of tensors of its own (a dropout mask, a loss's log-probabilities), as a fraction of the
    bytes of its largest input or of all its outputs (so that it scales with the op's local shapes)."""

    inputs: frozenset
    output: bool
    extra: float = 0.0


def everything(n_inputs: int) -> Saved:
    """The upper bound: every input and the output."""
    return Saved(frozenset(range(n_inputs)), True, 0.0)


NOTHING = Saved(frozenset(), False, 0.0)


def saved_by(node: fx.Node, in_names: tuple[str, ...], needs_grad: dict[str, bool], cache: dict) -> Saved:
    """What ``node`` (a ``call_function`` whose output needs a gradient) keeps for backward.

    ``in_names`` are its tensor inputs in `OpNode.inputs` order; ``needs_grad``
    says which producers' outputs need a gradient; ``cache`` is shared by the
    calls of one graph, so identical layers are probed once.
    """
    name = getattr(node.target, "_opname", getattr(node.target, "__name__", ""))
    values = {n.name: n.meta.get("val") for n in node.all_input_nodes}
    if not all(isinstance(values.get(n), torch.Tensor) for n in in_names):
        return everything(len(in_names))
    key = (str(node.target), _describe(node.args, values, needs_grad), _describe(node.kwargs, values, needs_grad),
           tuple(in_names.index(n) for n in in_names))  # mul(x, x) is not mul(x, y)
    if key not in cache:
        cache[key] = _attention(in_names) if name in ATTENTION else _probe(node, in_names, values, needs_grad)
    return cache[key]


def _attention(in_names) -> Saved:
    # q, k, v, a mask or bias (the fourth tensor input, if any: the memory-efficient kernel keeps it) and the
    # output; the log-sum-exp (one float per query row) is a fraction 4 / (head_dim * itemsize) of the output,
    # under 2% at head_dim 128: left out
    return Saved(frozenset(range(min(4, len(in_names)))), True, 0.0)


def _describe(tree, values, needs_grad):
    def one(a):
        if isinstance(a, fx.Node):
            v = values.get(a.name)
            return (tuple(v.shape), v.dtype, needs_grad.get(a.name, False)) if isinstance(v, torch.Tensor) else a.name
        return repr(a)
    return tuple(one(a) for a in pytree.tree_leaves(tree))


def _probe(node: fx.Node, in_names, values, needs_grad) -> Saved:
    """Run the op once on meta tensors and see what autograd packs."""
    made = {n: _meta_input(v, needs_grad.get(n)) for n, v in values.items() if isinstance(v, torch.Tensor)}
    args, kwargs = pytree.tree_map(lambda a: made.get(a.name, values.get(a.name)) if isinstance(a, fx.Node) else a,
                                   (node.args, node.kwargs))
    return _packed(node.target, args, kwargs, in_names, made)


def saved_by_op(target, args, kwargs, in_names: tuple[str, ...], needs_grad: dict[str, bool]) -> Saved | None:
    """`saved_by` for an op known only by its `autotp.graph.OpNode` record (``args`` and ``kwargs`` with each
    tensor input's `TensorMeta` in place of its node, ``in_names`` naming them in order): for a graph read off
    others at a new batch size (`autotp.graph.resize`). None when the record does not say which input is which
    (a tuple of tensors from one producer)."""
    from autotp.graph.opgraph import TensorMeta  # opgraph builds on this module

    metas = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorMeta)]
    if len(metas) != len(in_names):
        return None
    made = {}
    for name, meta in zip(in_names, metas):
        made.setdefault(name, _meta_input(meta, needs_grad.get(name)))
    names = iter(in_names)
    args, kwargs = pytree.tree_map(lambda a: made[next(names)] if isinstance(a, TensorMeta) else a,
                                   (args, kwargs))
    return _packed(target, args, kwargs, in_names, made)


def _meta_input(like, needs_grad: bool | None) -> torch.Tensor:
    """An input of ``like``'s shape and dtype on the meta device, wanting a gradient where its producer's
    output needs one (and it is floating point)."""
    t = torch.empty(like.shape, dtype=like.dtype, device="meta")
    return t.requires_grad_(bool(needs_grad) and t.is_floating_point())


def _packed(target, args, kwargs, in_names, made: dict) -> Saved:
    """Run ``target`` on meta tensors (``made``: the inputs by name) and match what autograd packs."""
    packed = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = target(*args, **kwargs)
    except Exception:  # no meta kernel, a data-dependent shape: keep everything
        return everything(len(in_names))
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    storage = {made[n].untyped_storage()._cdata: n for n in in_names}
    out_storages = {t.untyped_storage()._cdata for t in outs}
    largest = max([sum(t.numel() * t.element_size() for t in outs)]  # all outputs, as the memory model counts
                  + [made[n].numel() * made[n].element_size() for n in in_names]) or 1
    inputs, output, extra, seen = set(), False, 0, set()
    for t in packed:
        key = t.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        if key in storage:
            inputs.update(i for i, n in enumerate(in_names) if n == storage[key])
        elif key in out_storages:
            output = True
        elif t.is_floating_point() or t.dtype == torch.bool:
            extra += t.numel() * t.element_size()
    return Saved(frozenset(inputs), output, extra / largest)
