"""Capture a deep model by tracing a few of its identical layers and replaying the last one for the rest.

``torch.export`` costs about 5 ms per ATen op, so the 80 layers of a
Llama-2-70B take 25 s to trace although every layer records the same ops.
When a model keeps its layers in an ``nn.ModuleList`` (or ``nn.Sequential``)
whose entries are one class with the same parameter shapes (a *stack*), we
export the model with only its first `TRACED` layers and write the others into
the graph by copying the last traced layer, renaming its parameters and
re-pointing its inputs.

Replaying is exact only if layer ``k`` records the same ops as layer ``k-1``
did, wired the same way. That is checked, not assumed: among the traced
layers, each one must relate to its predecessor exactly as the one before did
(same ops, same literals, same shared inputs, its input taken from the same
output of the layer before, parameters renamed only by index), and nothing
outside the stack may read any layer but the last. Any difference, and a
config field that varies per layer (``layer_types``, ``no_rope_layers``, ...),
makes `capture` trace the whole model instead. What the check cannot see is
a layer whose Python code branches on its index with a period longer than the
traced layers (every fifth layer, say) without saying so in its config; pass
``replay_layers=False`` to ``plan`` for such a model.
"""

from __future__ import annotations

import copy
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

TRACED = 4  # layers traced per stack: layers 1, 2 and 3 are each checked against the one before
MIN_LAYERS = TRACED + 1  # below this, tracing everything is as cheap


@dataclass(frozen=True)
class Stack:
    """A list of identical layers: ``path`` is its module path (``model.layers``)."""

    path: str
    layers: torch.nn.Module

    def __len__(self) -> int:
        return len(self.layers)


class NotReplayable(Exception):
    """The traced layers do not repeat: capture traces every layer instead. The message says why."""


def _tensor_specs(module: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return params, buffers


def _is_stack(module: torch.nn.Module) -> bool:
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < MIN_LAYERS:
        return False
    names = list(module._modules)
    layers = list(module._modules.values())
    if names != [str(i) for i in range(len(layers))] or len({id(m) for m in layers}) != len(layers):
        return False
    if len({type(m) for m in layers}) != 1 or len({_tensor_specs(m) for m in layers}) != 1:
        return False
    tensors = [id(t) for m in layers for t in list(m.parameters()) + list(m.buffers())]
    return len(tensors) == len(set(tensors))  # no weight shared between layers


def find_stacks(model: torch.nn.Module) -> list[Stack]:
    """The outermost stacks of ``model`` with at least `MIN_LAYERS` layers."""
    stacks: list[Stack] = []
    for path, module in model.named_modules():
        if any(path.startswith(s.path + ".") for s in stacks):
            continue
        if path and _is_stack(module):
            stacks.append(Stack(path, module))
    return stacks


def per_layer_config(model: torch.nn.Module, stacks: list[Stack]) -> str | None:
    """A config field that gives layers different values (``layer_types``...), or None.

    Such a field means layers may run different code, so replaying one layer
    for the others could be wrong even when the traced layers agree.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    sizes = {len(s) for s in stacks}
    fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    for name, value in sorted(fields.items()):
        if isinstance(value, (list, tuple)) and len(value) in sizes and len({repr(v) for v in value}) > 1:
            return f"config.{name} differs between layers"
    return None


@contextmanager
def truncated(model: torch.nn.Module, stacks: list[Stack], n: int = TRACED):
    """Swap each stack for a list of its first ``n`` layers while the block runs."""
    swapped = []
    try:
        for stack in stacks:
            parent_path, _, name = stack.path.rpartition(".")
            parent = model.get_submodule(parent_path)
            kept = list(stack.layers)[:n]
            short = torch.nn.Sequential(*kept) if isinstance(stack.layers, torch.nn.Sequential) \
                else torch.nn.ModuleList(kept)
            swapped.append((parent, name, stack.layers))
            parent._modules[name] = short
        yield
    finally:
        for parent, name, full in reversed(swapped):
            parent._modules[name] = full


class _Layers:
    """Where each traced layer's ops sit in the graph of the truncated model."""

    def __init__(self, gm: fx.GraphModule, stack: Stack):
        self.path = stack.path
        self.ops: list[list[fx.Node]] = [[] for _ in range(TRACED)]
        self.where: dict[fx.Node, tuple[int, int]] = {}  # node -> (layer, position in the layer)
        sequence = []
        for node in gm.graph.nodes:
            layer = self._layer_of(node)
            if layer is None:
                sequence.append(None)
                continue
            self.where[node] = (layer, len(self.ops[layer]))
            self.ops[layer].append(node)
            sequence.append(layer)
        self._check_contiguous(sequence)

    def _layer_of(self, node: fx.Node) -> int | None:
        if node.op != "call_function":
            return None
        stack = node.meta.get("nn_module_stack") or {}
        prefix = self.path + "."
        for path, _ in stack.values():
            if path.startswith(prefix):
                return int(path[len(prefix):].split(".")[0])
        return None

    def _check_contiguous(self, sequence: list[int | None]) -> None:
        inside = [layer for layer in sequence if layer is not None]
        first = sequence.index(0) if 0 in sequence else None
        if first is None or inside != sorted(inside) or set(inside) != set(range(TRACED)):
            raise NotReplayable(f"the layers of {self.path} do not run one after another")
        if None in sequence[first:first + len(inside)]:
            raise NotReplayable(f"{self.path}: ops outside the layers run between them")
        if len({len(ops) for ops in self.ops}) != 1:
            raise NotReplayable(f"the traced layers of {self.path} record different numbers of ops")

    def param_rest(self, node: fx.Node, layer: int) -> str | None:
        """``self_attn.q_proj.weight`` for a ``get_attr`` of ``<path>.<layer>.self_attn.q_proj.weight``."""
        prefix = f"{self.path}.{layer}."
        if node.op == "get_attr" and str(node.target).startswith(prefix):
            return str(node.target)[len(prefix):]
        return None


def _value_spec(node: fx.Node):
    def one(v):
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
    return pytree.tree_map(one, node.meta.get("val"))


def _relation(layers: _Layers, a, b, i: int):
    """How input ``a`` of an op in layer ``i`` relates to the same input ``b`` of layer ``i - 1``."""
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        if type(a) is not type(b) or a != b:
            raise NotReplayable(f"layers {i - 1} and {i} of {layers.path} use different constants ({b!r}, {a!r})")
        return ("literal", repr(a))
    wa, wb = layers.where.get(a), layers.where.get(b)
    if wa is not None and wa[0] == i and wb == (i - 1, wa[1]):
        return ("internal", wa[1])
    if wa is not None and wa[0] == i - 1 and (wb == (i - 2, wa[1]) if i >= 2 else wb is None):
        return ("carry", wa[1])
    rest = layers.param_rest(a, i)
    if rest is not None and rest == layers.param_rest(b, i - 1):
        return ("param", rest)
    if a is b and wa is None and layers.param_rest(a, i) is None:
        return ("shared", a.name)
    raise NotReplayable(f"an input of layer {i} of {layers.path} ({a.name}) is not wired as in layer {i - 1} "
                        f"({b.name})")


def _relations(layers: _Layers, i: int) -> list:
    """What every op of layer ``i`` computes and from what, relative to layer ``i - 1``."""
    relations = []
    for node, before in zip(layers.ops[i], layers.ops[i - 1]):
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        leaves_before, spec_before = pytree.tree_flatten((before.args, before.kwargs))
        if node.target != before.target or spec != spec_before or _value_spec(node) != _value_spec(before):
            raise NotReplayable(f"layers {i - 1} and {i} of {layers.path} differ at {before.name} / {node.name}")
        relations.append(tuple(_relation(layers, a, b, i) for a, b in zip(leaves, leaves_before)))
    return relations


def check(gm: fx.GraphModule, stack: Stack) -> _Layers:
    """The traced layers of ``stack`` in ``gm``, after checking that each repeats the one before."""
    layers = _Layers(gm, stack)
    first = _relations(layers, 1)
    for i in range(2, TRACED):
        if _relations(layers, i) != first:
            raise NotReplayable(f"layer {i} of {stack.path} is not wired as layers 1 to {i - 1} are")
    for node in gm.graph.nodes:
        if node in layers.where:
            continue
        for a in node.all_input_nodes:
            if a in layers.where and layers.where[a][0] != TRACED - 1:
                raise NotReplayable(f"{node.name} reads layer {layers.where[a][0]} of {stack.path} from outside "
                                    "it (only the last layer's output may leave the stack)")
            if a.op == "get_attr" and str(a.target).startswith(stack.path + "."):
                raise NotReplayable(f"{node.name} reads {a.target} from outside {stack.path} (self.layers[-1] "
                                    "would name another layer in the cut model)")
    return layers


def _renumber(meta: dict, path: str, old: int, new: int) -> dict:
    """Copy of a node's meta with module paths under ``<path>.<old>`` moved to ``<path>.<new>``."""
    pattern = re.compile(rf"{re.escape(path)}\.{old}(?=\.|$)")
    meta = copy.copy(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        meta["nn_module_stack"] = {pattern.sub(f"{path}.{new}", key): (pattern.sub(f"{path}.{new}", p), t)
                                   for key, (p, t) in stack.items()}
    return meta


def _attach(gm: fx.GraphModule, target: str, tensor: torch.Tensor, persistent: bool) -> None:
    """Register ``tensor`` on ``gm`` at ``target``: a parameter as a parameter, anything else as a buffer."""
    *parents, leaf = target.split(".")
    module = gm
    for part in parents:
        if part not in module._modules:
            module.add_module(part, torch.nn.Module())
        module = module._modules[part]
    if isinstance(tensor, torch.nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def _attach_layer(gm: fx.GraphModule, stack: Stack, k: int) -> None:
    """Layer ``k``'s own parameters and buffers (the model's tensors) on ``gm``, under their full names."""
    for module_name, module in stack.layers[k].named_modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                path = ".".join(p for p in (stack.path, str(k), module_name, name) if p)
                _attach(gm, path, tensor, persistent=name not in module._non_persistent_buffers_set)


def replay(gm: fx.GraphModule, stack: Stack, layers: _Layers) -> None:
    """Write layers ``TRACED .. len(stack) - 1`` into ``gm`` as copies of the last traced layer.

    Each layer's ``get_attr`` nodes go after the previous layer's, and its ops
    after the previous layer's ops, so the graph lists nodes in the order a
    full trace does (layer sharing compares layers node by node).
    """
    graph, last = gm.graph, TRACED - 1
    pattern = layers.ops[last]
    pattern_params = [n for n in graph.nodes if layers.param_rest(n, last) is not None]
    outside_users = [(user, a) for a in pattern for user in a.users if user not in layers.where]
    params_anchor, ops_anchor = pattern_params[-1].next if pattern_params else None, pattern[-1].next
    previous = pattern
    for k in range(TRACED, len(stack)):
        _attach_layer(gm, stack, k)
        params = {}
        with graph.inserting_before(params_anchor):
            for node in pattern_params:
                params[node] = graph.get_attr(f"{stack.path}.{k}.{layers.param_rest(node, last)}")
                params[node].meta = copy.copy(node.meta)
        current: list[fx.Node] = []

        def remap(a: fx.Node, previous=previous, current=current, params=params) -> fx.Node:
            where = layers.where.get(a)
            if where is not None:
                return current[where[1]] if where[0] == last else previous[where[1]]
            return params.get(a, a)

        with graph.inserting_before(ops_anchor):
            for node in pattern:
                new = graph.node_copy(node, remap)
                new.meta = _renumber(node.meta, stack.path, last, k)
                current.append(new)
        previous = current
    for user, a in outside_users:
        user.replace_input_with(a, previous[layers.where[a][1]])
