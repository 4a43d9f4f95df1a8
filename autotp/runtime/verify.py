"""Check a plan numerically: run it on this rank and compare with the single-device model.

Outputs and every parameter gradient are compared; a gradient is compared with
this rank's slice of the single-device gradient, the contract of `parallelize`.
"""

from __future__ import annotations

import copy

import torch

from autotp.lower import shard_tensor
from autotp.placement import parse_layout


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    return []


def _loss(outputs) -> torch.Tensor:
    return sum(t.float().sum() for t in outputs if t.is_floating_point())


def max_errors(model: torch.nn.Module, plan, inputs, rank: int, groups=None) -> dict[str, float]:
    """Max absolute error of outputs and of each parameter's gradient, this rank against one device."""
    from autotp.api import parallelize

    reference = copy.deepcopy(model)
    ref_out = _tensors(reference(*inputs))
    _loss(ref_out).backward()
    local = parallelize(model, plan, rank=rank, groups=groups)
    out = _tensors(local(*inputs))
    _loss(out).backward()
    coords, shape = plan.mesh.coords(rank), plan.mesh.shape
    errors = {"output": max((float((a.detach() - b.detach()).abs().max()) for a, b in zip(out, ref_out)), default=0.0)}
    ref_params = dict(reference.named_parameters())
    grads = []
    for name, param in local.named_parameters():
        expected = ref_params[name].grad
        if expected is None:
            continue
        want = shard_tensor(expected, parse_layout(plan.parameters[name]), shape, coords)
        got = param.grad if param.grad is not None else torch.zeros_like(want)
        grads.append(float((got - want).abs().max()) if got.shape == want.shape else float("inf"))
    errors["gradient"] = max(grads, default=0.0)
    errors["parameters"] = len(grads)
    return errors
