"""Capture a model through ``torch.export`` (non-strict) into an ATen-level GraphModule.

Non-strict export traces the Python code as it runs, so Hugging Face models and
models built on the ``meta`` device capture without real weights. The result is
``ExportedProgram.module()``: parameters are ``get_attr`` nodes named by their
fully qualified names, and the module still trains with autograd, which is what
the lowering rewrites.
"""

from __future__ import annotations

import inspect
import os
import traceback

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autotp.capture.hf import capture_settings
from autotp.capture.normalize import normalize
from autotp.capture.replay import TRACED, NotReplayable, check, find_stacks, per_layer_config, replay, truncated
from autotp.dtypes import check_dtype, dtype_name, parse_dtype
from autotp.errors import CaptureError, InputError

# words in an error raised while tracing that say the inputs' shapes do not fit the model
_SHAPE_WORDS = ("shape", "size of tensor", "reduction dim", "dimension", "must match the size")


def _describe_export_failure(exc: Exception) -> str:
    """The user-code line where tracing failed, so the error names the failing op or line."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _in_package(f.filename)]
    user = [f for f in user if not f.filename.startswith("<")] or user  # a real file before generated code
    where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line})" if user else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first}{where}"


_AUTOTP = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # autotp/capture/export.py -> autotp/
_PACKAGES = tuple(os.path.join(d, "") for d in (os.path.dirname(os.path.realpath(torch.__file__)), _AUTOTP))


def _in_package(filename: str) -> bool:
    """Whether a traceback frame's file is torch's or autotp's own, told by where the packages are installed (a
    user's file under a folder that happens to be named ``autotp`` or ``torch`` is the user's)."""
    return os.path.realpath(filename).startswith(_PACKAGES)


def _describe_inputs(args: tuple, kwargs: dict) -> str:
    """``float32[8, 17], mask=bool[8]``: what the example inputs were, for a mismatch message."""
    def one(v):
        return f"{dtype_name(v.dtype)}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) or "none"


def _export_error(model, exc: Exception, args: tuple, kwargs: dict) -> CaptureError:
    """`InputError` when the inputs' shapes do not fit the model, else `CaptureError` with the fix for its kind."""
    name, what = type(model).__name__, _describe_export_failure(exc)
    message = str(exc).lower()
    if isinstance(exc, (RuntimeError, ValueError, IndexError)) and any(w in message for w in _SHAPE_WORDS) \
            and "data-dependent" not in message:
        return InputError(f"example inputs ({_describe_inputs(args, kwargs)}) do not fit {name}: {what}. "
                          "Pass inputs of the shapes and dtypes forward() expects")
    if "data-dependent" in message or "guard" in message:
        fix = ("control flow on a tensor's value cannot be captured: compute both branches and pick with "
               "torch.where, or use torch.cond, on that line")
    else:
        fix = ("torch.export traces forward() with fake tensors: replace that line's non-torch call "
               "(.numpy(), .tolist(), Python I/O) with torch ops")
    return CaptureError(f"torch.export could not capture {name}: {what}. Fix: {fix}")


def check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse inputs that do not bind to ``forward``'s signature, and unsupported dtypes, before tracing."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: nothing to check against
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputError(f"example inputs ({_describe_inputs(args, kwargs)}) do not match "
                             f"{type(model).__name__}.forward{signature}: {exc}; pass one example per "
                             "argument of forward()") from None
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        check_dtype(tensor.dtype, f"{type(model).__name__}'s {name!r}")
    named = [(f"example input #{i}", a) for i, a in enumerate(args)] + [(f"example input {k!r}", v)
                                                                        for k, v in kwargs.items()]
    for what, value in named:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                check_dtype(leaf.dtype, what)


def _source_line(node: fx.Node) -> str:
    """`` at file.py:12 (code)`` from the node's stack trace, or nothing."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    where = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not where:
        return ""
    i = where[-1]
    code = lines[i + 1] if i + 1 < len(lines) else ""
    return f" at {lines[i].removeprefix('File ').split(', in ')[0]}" + (f" ({code})" if code else "")


def check_graph_dtypes(gm: fx.GraphModule) -> None:
    """Refuse an op inside the model that makes an unsupported dtype (e.g. ``view_as_complex``)."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                check_dtype(value.dtype, f"op {node.target} (node {node.name!r}){_source_line(node)}",
                            "rewrite that line with real tensors (rotary embeddings with cos and sin, as "
                            "Hugging Face's Llama does)")


def capture(model: torch.nn.Module, example_inputs=(), example_kwargs=None, *,
            replay_layers: bool = True) -> fx.GraphModule:
    """Export ``model`` at ATen level and return its normalized, trainable GraphModule.

    Example inputs may be real, ``meta`` or fake tensors; only their shapes and
    dtypes matter. Raises :class:`CaptureError` naming the failing line.
    ``replay_layers`` traces only the first layers of a deep stack of identical
    layers and replays them for the rest (`autotp.capture.replay`: checked,
    with a full trace as the fallback); ``gm.meta["autotp_capture"]`` says
    what was replayed, or why not.
    """
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    check_inputs(model, example_inputs, example_kwargs)
    stacks = find_stacks(model) if replay_layers else []
    reason = per_layer_config(model, stacks) if stacks else None
    gm, report = None, {"replayed": {}, "traced_in_full": reason}
    if stacks and reason is None:
        try:
            with truncated(model, stacks):
                gm = _export(model, example_inputs, example_kwargs)
            checked = [(stack, check(gm, stack)) for stack in stacks]
        except (NotReplayable, CaptureError) as exc:  # a forward that needs every layer: trace them all
            gm, report["traced_in_full"] = None, str(exc)
        else:
            for stack, layers in checked:
                replay(gm, stack, layers)
                report["replayed"][stack.path] = len(stack) - TRACED
    if gm is None:
        gm = _export(model, example_inputs, example_kwargs)
    merge_tied_parameters(gm, {id(p): name for name, p in model.named_parameters()})
    normalize(gm)  # lints once for every pass above; its code is written when first needed (`lazycode`)
    gm.meta["autotp_capture"] = report
    return gm


def _export(model, example_inputs: tuple, example_kwargs: dict) -> fx.GraphModule:
    """``torch.export`` (non-strict) of ``model``, unlifted to a GraphModule without its input guards."""
    try:
        with capture_settings(model):
            program = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure becomes one clear error
        raise _export_error(model, exc, example_inputs, example_kwargs) from exc
    check_graph_dtypes(program.graph_module)
    gm = program.module()
    _drop_guards(gm)
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


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove export's input-guard call: the lowered module checks its own inputs."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)


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
    value = torch.zeros(spec["shape"], dtype=parse_dtype(spec["dtype"], "the plan's example inputs"), device=device)
    return value.requires_grad_() if spec.get("requires_grad") and value.is_floating_point() else value


def inputs_from_specs(specs: dict, device="meta") -> tuple[tuple, dict]:
    """Zero tensors matching stored input specs: enough to re-capture the same graph."""
    return (tuple(_value(s, device) for s in specs["args"]),
            {k: _value(s, device) for k, s in specs["kwargs"].items()})
