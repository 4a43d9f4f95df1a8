"""Check a plan numerically: run it on this rank and compare with the single-device model.

Outputs and every parameter gradient are compared; a gradient is compared with
this rank's slice of the single-device gradient, the contract of `parallelize`.
Errors are scaled: ``max|a - b| / max(1, max|b|)``, the absolute error for
values up to 1 and the relative error above (summing every output of a
transformers model makes gradients in the hundreds).
"""

from __future__ import annotations

import copy

import torch

from autotp.lower import shard_tensor
from autotp.lower.rewrite import parameter_aliases
from autotp.placement import parse_layout


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    return []


def scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max(1, max|want|)``: absolute near zero, relative for large values."""
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _loss(outputs) -> torch.Tensor:
    return sum(t.float().sum() for t in outputs if t.is_floating_point())


def max_errors(model: torch.nn.Module, plan, inputs, rank: int, groups=None, kwargs=None) -> dict[str, float]:
    """Max absolute error of outputs and of each parameter's gradient, this rank against one device."""
    from autotp.api import parallelize

    kwargs = kwargs or {}
    reference = copy.deepcopy(model)
    ref_out = _tensors(reference(*inputs, **kwargs))
    _loss(ref_out).backward()
    local = parallelize(model, plan, rank=rank, groups=groups)
    out = _tensors(local(*inputs, **kwargs))
    _loss(out).backward()
    coords, shape = plan.mesh.coords(rank), plan.mesh.shape
    layouts = plan.io.get("outputs") or [("R",) * plan.mesh.ndim] * len(ref_out)
    errors = {"output": max((scaled_error(a, shard_tensor(b, parse_layout(layout), shape, coords))
                             if a.shape == shard_tensor(b, parse_layout(layout), shape, coords).shape else float("inf")
                             for a, b, layout in zip(out, ref_out, layouts)), default=0.0)}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    grads = []
    for names, param in parameter_aliases(local):
        name = next(n for n in names if n in plan.parameters)
        expected = ref_params[name].grad
        if expected is None:
            continue
        want = shard_tensor(expected, parse_layout(plan.parameters[name]), shape, coords)
        got = param.grad if param.grad is not None else torch.zeros_like(want)
        grads.append(scaled_error(got, want) if got.shape == want.shape else float("inf"))
    errors["gradient"] = max(grads, default=0.0)
    errors["parameters"] = len(grads)
    return errors
