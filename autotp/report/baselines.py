"""The plans a person would otherwise write, costed through the same pipeline as autotp's own.

- **replicated**: every tensor whole on every device (the single-device program, N times);
- **data-parallel**: parameters whole, and every tensor whose dim 0 is a
  multiple of the batch split on dim 0 over every mesh axis (`data_parallel_only`
  alone would let the ILP keep a small model replicated);
- **megatron**: column-parallel q/k/v/up/gate and row-parallel o/down/proj on the
  last mesh axis, every other parameter replicated; activation layouts are left
  to the ILP, as a hand-written plan leaves them to DTensor.

Each is `autotp.plan` with pins or a strategy filter, so its step time and
memory are comparable with the ILP's. A baseline this model or mesh cannot
take (shapes the mesh does not divide, a memory limit) is kept with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autotp.errors import AutotpError
from autotp.graph.opgraph import KIND_PARAM
from autotp.interop import pins_from_styles
from autotp.placement import Shard
from autotp.solve.constraints import data_parallel_only, replicated_only

COLUMN = ("q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "up_proj", "gate_proj", "up", "gate",
          "fc1", "w1", "w3", "c_attn", "c_fc")
ROW = ("o_proj", "down_proj", "out_proj", "proj", "down", "fc2", "w2", "c_proj", "attention.output.dense",
       "output.dense")
NAMES = ("replicated", "data-parallel", "megatron")


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


def baseline_plans(model, mesh, example_inputs, example_kwargs=None, **plan_kwargs) -> list[Baseline]:
    """The three baselines for ``model`` on ``mesh``; ``plan_kwargs`` as for `autotp.plan` (profile, training...)."""
    from autotp.api import plan

    out = []
    for name in NAMES:
        kwargs = dict(plan_kwargs)
        if name == "replicated":
            kwargs["allow"] = replicated_only
        elif name == "data-parallel":
            batch = _batch_size(example_inputs)
            if batch is None or batch % mesh.size:
                out.append(Baseline(name, None, f"the batch ({batch}) does not split over {mesh.size} devices"))
                continue
            kwargs["allow"] = batch_split_only(batch)
        else:
            styles = megatron_styles(model)
            if not styles:
                out.append(Baseline(name, None, "no Linear layers named q/k/v/up/gate or o/down/proj"))
                continue
            kwargs["pin"] = pins_from_styles(model, styles, mesh.ndim)
        try:
            result = plan(model, mesh, example_inputs, example_kwargs, **kwargs)
        except AutotpError as exc:
            out.append(Baseline(name, None, str(exc)))
            continue
        out.append(Baseline(name, result))
    return out


def batch_split_only(batch: int):
    """A filter for pure data parallelism: tensors that carry the batch on dim 0 are split there on every axis."""

    def allow(op, strategy) -> bool:
        if not data_parallel_only(op, strategy):
            return False
        carries_batch = op.kind != KIND_PARAM and op.out and op.out[0].shape and op.out[0].shape[0] % batch == 0
        return not carries_batch or all(p == Shard(0) for p in strategy.out)

    return allow


def _batch_size(example_inputs) -> int | None:
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim()), None)
    return None if first is None else first.shape[0]
