"""The plans a person would otherwise write, costed through the same pipeline as autotp's own.

- **replicated**: every tensor whole on every device (the single-device program, N times);
- **data-parallel**: parameters whole, and every tensor that carries the
  batch (made from an input whose dim 0 is the batch, its own dim 0 a
  multiple of it) split on dim 0 over every mesh axis (`data_parallel_only`
  alone would let the ILP keep a small model replicated);
- **megatron**: column-parallel q/k/v/up/gate and row-parallel o/down/proj on the
  last mesh axis, every other parameter replicated; activation layouts are left
  to the ILP, as a hand-written plan leaves them to DTensor;
- **megatron-sp**: the same weights, with sequence parallelism: no activation
  of the residual stream's width is replicated on that axis, so each
  all-reduce becomes a reduce-scatter and an all-gather, and the norms and
  residual adds between the blocks run on a slice of the sequence;
- **fsdp**: FSDP, ZeRO-3 over every device: the batch split as in
  data-parallel, and every parameter stored split on every mesh axis (one
  too small for that stays whole), all-gathered at use and, when memory
  binds, gathered again in backward (`autotp.solve.regather`).

Each is `autotp.plan` on the same capture with pins or a strategy filter, so
its step time and memory are comparable with the ILP's, and each is a point
of the ILP's own search space: autotp's plan is never predicted slower (the
suite checks it, tests/test_optimal.py). A baseline this model or mesh cannot
take (shapes the mesh does not divide, a memory limit) is kept with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.graph.opgraph import KIND_PARAM
from autotp.interop import pins_from_styles
from autotp.placement import Replicate, Shard
from autotp.solve.constraints import data_parallel_only, replicated_only

COLUMN = ("q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "up_proj", "gate_proj", "up", "gate",
          "fc1", "w1", "w3", "c_attn", "c_fc")
ROW = ("o_proj", "down_proj", "out_proj", "proj", "down", "fc2", "w2", "c_proj", "attention.output.dense",
       "output.dense")
NAMES = ("replicated", "data-parallel", "megatron", "megatron-sp", "fsdp")


@dataclass(frozen=True)
class Baseline:
    """One baseline's plan, or why there is none."""

    name: str
    plan: object | None  # Plan
    reason: str = ""


def megatron_styles(model: nn.Module) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` for Linear-like modules named as Megatron splits them."""
    styles = {}
    for path, module in model.named_modules():
        if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if any(path == n or path.endswith("." + n) for n in ROW):
            styles[path] = "rowwise"
        elif any(path == n or path.endswith("." + n) for n in COLUMN):
            styles[path] = "colwise"
    return styles


def baseline_plans(model, mesh, example_inputs, example_kwargs=None, captured=None, names=NAMES,
                   **plan_kwargs) -> list[Baseline]:
    """The baselines for ``model`` on ``mesh``; ``plan_kwargs`` as for `autotp.plan` (profile, training...).

    ``captured`` (`autotp.api.capture_model`) reuses a capture; by default the model is captured once here.
    ``names`` picks some of `NAMES`. Each baseline has the plan's memory levers
    (optimizer state split, recomputation) as its ILP chooses them under the
    same limit, one micro-batch a step: ``megatron-sp`` under a memory limit
    is Megatron-LM's recipe (tensor and sequence parallelism on the last
    axis, its distributed optimizer, recomputation) costed in the same model.
    """
    from autotp.api import as_mesh, capture_model, plan_captured

    mesh = as_mesh(mesh)
    replay = plan_kwargs.pop("replay_layers", True)
    captured = captured or capture_model(model, example_inputs, example_kwargs, replay)
    out = []
    for name in names:
        kwargs, why = _constraints(name, model, mesh, example_inputs, captured.graph)
        if why:
            out.append(Baseline(name, None, why))
            continue
        try:
            out.append(Baseline(name, plan_captured(captured, mesh, **plan_kwargs, **kwargs)))
        except AutotpError as exc:
            out.append(Baseline(name, None, str(exc)))
    return out


def _constraints(name: str, model, mesh, example_inputs, graph) -> tuple[dict, str]:
    """The pins or filter of one baseline, or why it does not apply to this model."""
    if name == "replicated":
        return {"allow": replicated_only}, ""
    if name in ("data-parallel", "fsdp"):
        batch = _batch_size(example_inputs)
        if batch is None or batch % mesh.size:
            return {}, f"the batch ({batch}) does not split over {mesh.size} devices"
        return {"allow": batch_split_only(batch, graph) if name == "data-parallel"
                else fully_sharded_only(batch, mesh.shape, graph)}, ""
    styles = megatron_styles(model)
    if not styles:
        return {}, "no Linear layers named q/k/v/up/gate or o/down/proj"
    pins = pins_from_styles(model, styles, mesh.ndim)
    if name == "megatron":
        return {"pin": pins}, ""
    return {"pin": pins, "allow": sequence_parallel_only(_residual_width(model, styles), mesh.ndim - 1)}, ""


def _residual_width(model, styles: dict) -> int:
    """The width of the residual stream: what the column-parallel layers read."""
    modules = dict(model.named_modules())
    widths = [getattr(modules[path], "in_features", None) or modules[path].weight.shape[0]
              for path, style in styles.items() if style == "colwise"]
    return max(set(widths), key=widths.count)


def sequence_parallel_only(width: int, axis: int):
    """A filter for Megatron's sequence parallelism: no activation ``[batch, seq, width]`` replicated on ``axis``."""

    def allow(op, strategy) -> bool:
        stream = (op.kind != KIND_PARAM and op.out and len(op.out[0].shape) == 3 and op.out[0].shape[-1] == width
                  and op.out[0].is_float)
        return not stream or not isinstance(strategy.out[axis], Replicate)

    return allow


def batch_split_only(batch: int, graph=None):
    """A filter for pure data parallelism: tensors that carry the batch are split on dim 0 on every axis.

    A tensor carries the batch when its dim 0 is a multiple of ``batch`` and,
    given the ``graph`` (an `OpGraph`), it is made from an input whose dim 0
    is the batch: a sequence-length vector of a position embedding or of a
    causal mask, whose length the batch may divide, does not.
    """
    carriers = None if graph is None else batch_carriers(graph, batch)

    def allow(op, strategy) -> bool:
        if not data_parallel_only(op, strategy):
            return False
        carries_batch = (op.kind != KIND_PARAM and op.out and op.out[0].shape and op.out[0].shape[0] % batch == 0
                         and (carriers is None or op.name in carriers))
        return not carries_batch or all(p == Shard(0) for p in strategy.out)

    return allow


def fully_sharded_only(batch: int, mesh_shape, graph=None):
    """A filter for FSDP: data parallelism (`batch_split_only`), each parameter split on every axis of size > 1."""
    data = batch_split_only(batch, graph)

    def allow(op, strategy) -> bool:
        if op.kind == KIND_PARAM:
            return all(isinstance(p, Shard) for p, n in zip(strategy.out, mesh_shape) if n > 1)
        return data(op, strategy)

    return allow


def batch_carriers(graph, batch: int) -> set[str]:
    """Nodes made from a program input whose dim 0 is ``batch``."""
    import networkx as nx

    starts = [op.name for op in graph.nodes() if op.kind == "input" and op.out[0].shape[:1] == (batch,)]
    return set(starts).union(*(nx.descendants(graph.graph, name) for name in starts))


def _batch_size(example_inputs) -> int | None:
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim()), None)
    return None if first is None else first.shape[0]
