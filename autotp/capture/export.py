"""Capture a model through ``torch.export`` (non-strict) into an ATen-level GraphModule.

Non-strict export traces the Python code as it runs, so Hugging Face models and
models built on the ``meta`` device capture without real weights. The result is
``ExportedProgram.module()``: parameters are ``get_attr`` nodes named by their
fully qualified names, and the module still trains with autograd, which is what
the lowering rewrites.
"""

from __future__ import annotations

import traceback

import torch
import torch.fx as fx

from autotp.capture.hf import capture_settings
from autotp.capture.normalize import normalize
from autotp.errors import CaptureError


def _describe_export_failure(exc: Exception) -> str:
    """The user-code line where tracing failed, so the error names the failing op or line."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/autotp/" not in f.filename]
    where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line})" if user else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first}{where}"


def capture(model: torch.nn.Module, example_inputs=(), example_kwargs=None) -> fx.GraphModule:
    """Export ``model`` at ATen level and return its normalized, trainable GraphModule.

    Example inputs may be real, ``meta`` or fake tensors; only their shapes and
    dtypes matter. Raises :class:`CaptureError` naming the failing line.
    """
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    try:
        with capture_settings(model):
            program = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure becomes one clear error
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {_describe_export_failure(exc)}. "
            "Check that example_inputs match forward()'s signature, or remove the data-dependent "
            "control flow on that line."
        ) from exc
    gm = program.module()
    _drop_guards(gm)
    merge_tied_parameters(gm, {id(p): name for name, p in model.named_parameters()})
    normalize(gm)
    return gm


def merge_tied_parameters(gm: fx.GraphModule, canonical: dict[int, str]) -> None:
    """One ``get_attr`` node per parameter tensor, named as ``model.named_parameters()`` names it.

    Tied weights (GPT-2's ``lm_head`` and ``wte``) are one parameter: they must
    get one placement and one gradient, so every use reads the same node.
    """
    kept: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        try:
            tensor = gm.get_parameter(node.target)
        except AttributeError:
            continue  # a buffer or constant
        key = id(tensor)
        if key in kept:
            node.replace_all_uses_with(kept[key])
            gm.graph.erase_node(node)
            continue
        kept[key] = node
        node.target = canonical.get(key, node.target)
    gm.graph.lint()
    gm.recompile()


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input-guard call: the lowered module checks its own inputs."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
    gm.recompile()


_LITERALS = (bool, int, float, str, type(None))


def _spec(value, where: str):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "requires_grad": bool(value.requires_grad)}
    if isinstance(value, _LITERALS):
        return {"value": value}
    raise CaptureError(f"example input {where} is a {type(value).__name__}; pass tensors, or plain "
                       "bool/int/float/str values")


def example_specs(example_inputs, example_kwargs=None) -> dict:
    """Shapes and dtypes of the example inputs (and plain keyword values), for storing in a plan."""
    return {"args": [_spec(x, f"#{i}") for i, x in enumerate(example_inputs)],
            "kwargs": {k: _spec(v, repr(k)) for k, v in sorted((example_kwargs or {}).items())}}


def _value(spec, device):
    if "value" in spec:
        return spec["value"]
    return torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)


def inputs_from_specs(specs: dict, device="meta") -> tuple[tuple, dict]:
    """Zero tensors matching stored input specs: enough to re-capture the same graph."""
    return (tuple(_value(s, device) for s in specs["args"]),
            {k: _value(s, device) for k, s in specs["kwargs"].items()})
