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
        program = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure becomes one clear error
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {_describe_export_failure(exc)}. "
            "Check that example_inputs match forward()'s signature, or remove the data-dependent "
            "control flow on that line."
        ) from exc
    gm = program.module()
    _drop_guards(gm)
    normalize(gm)
    return gm


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input-guard call: the lowered module checks its own inputs."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
    gm.recompile()


def example_specs(example_inputs) -> list[dict]:
    """Shape and dtype of each positional example input, for storing in a plan."""
    specs = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            raise CaptureError(f"example input of type {type(x).__name__} is not a tensor; pass tensors only")
        specs.append({"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")})
    return specs


def inputs_from_specs(specs, device="meta") -> tuple:
    """Zero tensors matching stored input specs: enough to re-capture the same graph."""
    return tuple(torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]), device=device) for s in specs)
