"""`OpGraph`: the captured program as a networkx DiGraph of frozen `OpNode`s.

Every fx node that produces tensors becomes an `OpNode` keyed by its fx name.
Edges run producer -> consumer and carry ``inputs``, the positions of the
consumer's tensor inputs that the producer feeds (an op may use one tensor
twice, as in ``mul(x, x)``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from autotp.graph.flops import is_alias, op_bytes, op_flops
from autotp.graph.saved import NOTHING, saved_by

KIND_INPUT, KIND_PARAM, KIND_BUFFER, KIND_OP, KIND_OUTPUT = "input", "param", "buffer", "op", "output"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor; the only facts planning needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def meta_of(value):
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(meta_of(v) for v in value)
    return None


@dataclass(frozen=True)
class OpNode:
    """One node of the program: what it computes and on which tensors.

    ``args``/``kwargs`` are the fx arguments with every input Node replaced by
    its `TensorMeta`, so strategy rules are pure functions of this record.
    ``out`` is a tuple of metas (one for most ops, several for ``split``).
    """

    name: str
    kind: str
    target: object
    args: tuple
    kwargs: dict = field(hash=False)
    inputs: tuple[str, ...]
    in_metas: tuple[TensorMeta, ...]
    out: tuple[TensorMeta, ...]
    multi_output: bool
    flops: int
    bytes: int
    requires_grad: bool
    fqn: str | None = None
    module: str | None = None  # path of the innermost module that ran the op (or owns the parameter)
    # what autograd keeps of it for backward (`autotp.graph.saved`): positions in ``inputs`` its backward
    # reads, whether its output is kept (its own backward or a consumer's reads it), and tensors of its own
    # (a dropout mask, a loss's log-probabilities) as a fraction of its largest tensor's bytes
    saves_inputs: frozenset = frozenset()
    keeps_output: bool = True
    saved_extra: float = 0.0

    @property
    def op_name(self) -> str:
        return getattr(self.target, "__name__", str(self.target)) if self.kind == KIND_OP else self.kind


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The fx Nodes among ``node``'s args and kwargs, in flattened order, repeats kept."""
    return [leaf for leaf in _leaves((node.args, node.kwargs), []) if isinstance(leaf, fx.Node)]


_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)


def _leaves(tree, out: list) -> list:
    """``pytree.tree_leaves(tree)`` appended to ``out``: the containers an fx node's arguments hold walked here,
    any other pytree node by pytree (pytree's generic walk took half of `build_opgraph`, two node walks per op)."""
    kind = type(tree)
    if kind in _SEQUENCES:
        for item in tree:
            _leaves(item, out)
    elif kind in _MAPPINGS:
        for item in tree.values():
            _leaves(item, out)
    elif isinstance(tree, tuple) or kind in pytree.SUPPORTED_NODES:
        out.extend(pytree.tree_leaves(tree))
    else:
        out.append(tree)
    return out


def _mapped(fn, tree):
    """``pytree.tree_map(fn, tree)``, the same way as `_leaves`: each container rebuilt as its own type."""
    kind = type(tree)
    if kind in _SEQUENCES:
        return kind(_mapped(fn, item) for item in tree)
    if kind in _MAPPINGS:
        return kind({key: _mapped(fn, item) for key, item in tree.items()})
    if isinstance(tree, tuple) or kind in pytree.SUPPORTED_NODES:
        return pytree.tree_map(fn, tree)
    return fn(tree)


class OpGraph:
    """The program as a DiGraph of `OpNode`s, in the fx graph's topological order."""

    def __init__(self, graph: nx.DiGraph, order: list[str], outputs: list[str]):
        self.graph = graph
        self.order = order
        self.outputs = outputs
        # the ops by name, read half a million times in costing a 70B model: a dict, not networkx's node views
        # (the graph is complete when it is wrapped, and never changed after)
        self._ops = {name: data["op"] for name, data in graph.nodes(data=True)}

    def node(self, name: str) -> OpNode:
        return self._ops[name]

    def nodes(self):
        return [self._ops[n] for n in self.order]

    def consumers(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(v, self.graph.edges[name, v]["inputs"]) for v in self.graph.successors(name)]

    def __len__(self) -> int:
        return len(self.order)


def _kind(node: fx.Node, params, buffers: set) -> str:
    """``params``: the parameters' names (any container: a dict of them is looked up as it is)."""
    if node.op == "placeholder":
        return KIND_INPUT
    if node.op == "get_attr":
        return KIND_PARAM if node.target in params else KIND_BUFFER
    if node.op == "output":
        return KIND_OUTPUT
    return KIND_OP


def build_opgraph(gm: fx.GraphModule, input_requires_grad=None) -> OpGraph:
    """Turn a captured GraphModule into an `OpGraph` with shapes, FLOPs and bytes.

    ``input_requires_grad`` maps placeholder names to whether their gradient is
    wanted; gradients of user inputs cost an extra all-reduce in some plans.
    """
    input_requires_grad = input_requires_grad or {}
    params = {n: p.requires_grad for n, p in gm.named_parameters()}
    buffers = {n for n, _ in gm.named_buffers()}
    g, order, metas, grads, outputs, probed = nx.DiGraph(), [], {}, {}, [], {}
    for node in gm.graph.nodes:
        kind = _kind(node, params, buffers)
        producers = tensor_input_nodes(node)
        if kind == KIND_OUTPUT:
            outputs = [p.name for p in producers]
            continue
        out = meta_of(node.meta.get("val"))
        if out is None and kind == KIND_PARAM:
            t = gm.get_parameter(node.target)
            out = TensorMeta(tuple(t.shape), t.dtype)
        if out is None:
            continue  # a node with no tensor output (e.g. a scalar) is left as is
        multi = isinstance(out, tuple)
        outs = out if multi else (out,)
        ins = tuple(_input_meta(node, metas[p.name]) for p in producers if p.name in metas)
        in_names = tuple(p.name for p in producers if p.name in metas)
        requires_grad = _requires_grad(kind, node, params, input_requires_grad, in_names, grads, outs)
        saved = (saved_by(node, in_names, grads, probed) if kind == KIND_OP and requires_grad and not is_alias(node.target)
                 else NOTHING)
        op = OpNode(
            name=node.name, kind=kind, target=node.target,
            args=_mapped(lambda a: _sub(a, metas), node.args),
            kwargs=_mapped(lambda a: _sub(a, metas), dict(node.kwargs)),
            inputs=in_names, in_metas=ins, out=outs, multi_output=multi,
            flops=op_flops(node.target, ins, outs) if kind == KIND_OP else 0,
            bytes=op_bytes(node.target, ins, outs) if kind == KIND_OP else 0,
            requires_grad=requires_grad,
            fqn=node.target if kind in (KIND_PARAM, KIND_BUFFER) else None,
            module=_module_path(node, kind),
            saves_inputs=saved.inputs, keeps_output=saved.output, saved_extra=saved.extra,
        )
        metas[node.name] = outs[0] if not multi else outs
        grads[node.name] = requires_grad
        g.add_node(node.name, op=op)
        order.append(node.name)
        for i, producer in enumerate(in_names):
            edge = g.edges[producer, node.name] if g.has_edge(producer, node.name) else None
            if edge is None:
                g.add_edge(producer, node.name, inputs=(i,))
            else:
                edge["inputs"] = edge["inputs"] + (i,)
    _mark_kept_outputs(g, order)
    return OpGraph(g, order, outputs)


def _mark_kept_outputs(g: nx.DiGraph, order: list[str]) -> None:
    """``keeps_output``: an op's output is kept when its own backward reads it, a consumer's backward reads it
    (directly or through views: a saved view keeps its base alive), or it leaves its layer for another one:
    a recomputed layer's checkpoint saves what enters it (`autotp.solve.recompute`), and the memory model
    counts it alike whether or not the layer is recomputed."""
    read = set()  # ops whose output some backward reads
    for name in reversed(order):  # consumers first: a view is marked before its base is looked at
        op = g.nodes[name]["op"]
        for i in op.saves_inputs:
            read.add(op.inputs[i])
        if name in read and op.kind == KIND_OP and is_alias(op.target):
            read.update(op.inputs)
    for name in order:
        op = g.nodes[name]["op"]
        if op.kind == KIND_OP and op.requires_grad and not is_alias(op.target):
            leaves = any(module_layer(g.nodes[v]["op"].module) != module_layer(op.module) for v in g.successors(name))
            g.nodes[name]["op"] = replace(op, keeps_output=op.keeps_output or name in read or leaves)


def module_layer(module: str | None) -> tuple[str, int] | None:
    """``("model.layers", 3)`` for a module path inside ``model.layers.3``; None outside a layer list.

    A layer is the first numbered module on the path: the entries of an
    ``nn.ModuleList`` or ``nn.Sequential``.
    """
    parts = (module or "").split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _module_path(node: fx.Node, kind: str) -> str | None:
    """The module an op ran in (from export's ``nn_module_stack``), or a parameter's owner."""
    if kind in (KIND_PARAM, KIND_BUFFER):
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


def _input_meta(node: fx.Node, meta):
    """The meta a consumer sees: ``getitem(split, i)`` sees the i-th piece of the split."""
    if isinstance(meta, tuple):
        return meta[node.args[1]] if node.target is operator.getitem else meta[0]
    return meta


def _sub(arg, metas):
    if isinstance(arg, fx.Node):
        m = metas.get(arg.name)
        return m if m is not None else arg.name
    return arg


def _requires_grad(kind, node, params, input_requires_grad, in_names, grads, outs) -> bool:
    if kind == KIND_PARAM:
        return params[node.target]
    if kind == KIND_INPUT:
        return bool(input_requires_grad.get(node.name, False)) and outs[0].is_float
    if kind == KIND_BUFFER:
        return False
    return any(grads[n] for n in in_names) and any(o.is_float for o in outs)
