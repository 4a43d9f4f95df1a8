"""Check a plan numerically: run it on this rank and compare with the single-device model.

Outputs and every parameter gradient are compared; a gradient is compared with
this rank's slice of the single-device gradient, the contract of `parallelize`.
Backward starts from a random upstream gradient, the same on both sides (each
rank takes its slice of it for a split output), not from ``sum()``, whose
all-ones gradient hides a permutation or a missing scale. Errors are scaled:
``max|a - b| / max(1, max|b|)``, the absolute error for values up to 1 and the
relative error above (summing every output of a transformers model makes
gradients in the hundreds), then divided by how much looser
`torch.testing.assert_close`'s default tolerance is for the tensor's dtype
than for float32 (bfloat16: 1.6e-2 / 1.3e-6), so one tolerance reads in
float32 terms for every dtype. A tensor whose shape or dtype differs from the
single device's is a mismatch (an infinite error), named in ``"mismatches"``.
Both sides start from the same generator state, so dropout draws the same
masks (`autotp.lower.random_ops`): models are checked with dropout on.
"""

from __future__ import annotations

import copy

import torch

from autotp.lower import shard_tensor
from autotp.lower.dtensor import local_grad, local_tensor
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


# torch.testing.assert_close's default rtol per dtype: a low-precision tensor is allowed proportionally more
_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}


def dtype_scale(dtype: torch.dtype) -> float:
    """How many times float32's tolerance a tensor of ``dtype`` is allowed (1 for float32 and wider)."""
    return max(1.0, _RTOL.get(dtype, _RTOL[torch.float32]) / _RTOL[torch.float32])


def scaled_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max(1, max|want|)``: absolute near zero, relative for large values (a DTensor: its
    local shard, which is what a rank holds)."""
    got, want = local_tensor(got).detach().double(), local_tensor(want).detach().double()
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _upstream(outputs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor | None]:
    """A random gradient for each floating-point output, drawn from its own generator: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=generator).to(t.dtype) if t.is_floating_point() else None
            for t in outputs]


def _loss(outputs, upstream) -> torch.Tensor:
    return sum((t.float() * g.float()).sum() for t, g in zip(outputs, upstream) if g is not None)


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, mismatches: list[str]) -> float:
    if got.shape != want.shape or got.dtype != want.dtype:
        mismatches.append(f"{what}: {tuple(got.shape)} {got.dtype} where one device has "
                          f"{tuple(want.shape)} {want.dtype}")
        return float("inf")
    return scaled_error(got, want) / dtype_scale(want.dtype)


def worst_gradient_error(local, reference, plan, rank: int) -> float:
    """The largest `scaled_error` of this rank module's gradients against their pieces of ``reference``'s (the
    single-device model, after the same step): the check of tests and of benchmarks/gpu_check.py."""
    coords, shape, ref = plan.mesh.coords(rank), plan.mesh.shape, dict(reference.named_parameters())
    return max(scaled_error(local_grad(p), shard_tensor(ref[n].grad, parse_layout(plan.parameters[n]), shape, coords))
               for n, p in local.named_parameters())


def max_errors(model: torch.nn.Module, plan, inputs, rank: int, groups=None, kwargs=None, captured=None) -> dict:
    """This rank against one device: the largest error of its outputs and of its parameters' gradients (in
    float32 terms, above), how many parameters were compared, and any shape or dtype mismatch named.
    ``captured``: ``model`` captured for ``plan`` (`autotp.api.capture_for`), lowered instead of capturing it."""
    from autotp.api import parallelize

    kwargs = kwargs or {}
    reference = copy.deepcopy(model)
    rng = torch.get_rng_state()  # both sides draw their random ops (dropout) from the same generator state
    ref_out = _tensors(reference(*inputs, **kwargs))
    upstream = _upstream(ref_out)
    _loss(ref_out, upstream).backward()
    local = parallelize(model, plan, rank=rank, groups=groups, captured=captured)
    torch.set_rng_state(rng)
    out = _tensors(local(*inputs, **kwargs))
    coords, shape = plan.mesh.coords(rank), plan.mesh.shape
    layouts = [parse_layout(layout) for layout in plan.io.get("outputs") or [("R",) * plan.mesh.ndim] * len(ref_out)]
    mismatches = []
    _loss(out, [None if g is None else shard_tensor(g, layout, shape, coords)
                for g, layout in zip(upstream, layouts)]).backward()
    errors = {"output": max((_compare(a, shard_tensor(b, layout, shape, coords), f"output {i}", mismatches)
                             for i, (a, b, layout) in enumerate(zip(out, ref_out, layouts))), default=0.0)}
    if len(out) != len(ref_out):
        mismatches.append(f"{len(out)} outputs where one device has {len(ref_out)}")
        errors["output"] = float("inf")
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    grads = []
    for names, param in parameter_aliases(local):
        name = next(n for n in names if n in plan.parameters)
        expected = ref_params[name].grad
        if expected is None:
            continue
        want = shard_tensor(expected, parse_layout(plan.parameters[name]), shape, coords)
        got = local_grad(param) if param.grad is not None else torch.zeros_like(want)
        grads.append(_compare(got, want, f"gradient of {name}", mismatches))
    errors["gradient"] = max(grads, default=0.0)
    errors["parameters"] = len(grads)
    errors["mismatches"] = mismatches
    return errors
