"""Plans in the vocabularies people already use: Hugging Face ``tp_plan`` and DTensor ``parallelize_module``.

Import turns a style per module into pinned parameter placements on the
tensor-parallel axis (the last mesh axis), for `autotp.plan(..., pin=...)` to
cost and compile. Export goes the other way where a plan can be said that way:
a Linear or Embedding whose weight is split on the tensor-parallel axis only.

    colwise  (Linear)    weight S(0), bias S(0)      rowwise  (Linear)    weight S(1), bias R
    colwise  (Embedding) weight S(1)                 rowwise  (Embedding) weight S(0)
"""

from __future__ import annotations

import re

from torch import nn

from autotp.errors import PlanError

_LINEAR = {"colwise": ("S(0)", "S(0)"), "rowwise": ("S(1)", "R")}
_EMBEDDING = {"colwise": ("S(1)", None), "rowwise": ("S(0)", None)}
_CONV1D = {"colwise": ("S(1)", "S(0)"), "rowwise": ("S(0)", "R")}  # transformers' Conv1D stores (in, out)
_HF_ALIASES = {"colwise_gather_output": "colwise", "colwise_rep": "colwise", "rowwise_rep": "rowwise",
               "local_colwise": "colwise", "local_rowwise": "rowwise", "embedding_rowwise": "rowwise"}


def _pattern(name: str) -> str:
    """``layers.*.mlp.up_proj`` as a regular expression over module paths."""
    return re.escape(name).replace(r"\*", r"\d+")


def _styles_by_module(model: nn.Module, styles: dict[str, str], prefix: str = "") -> dict[str, str]:
    out = {}
    for path, module in model.named_modules():
        for pattern, style in styles.items():
            if re.fullmatch(_pattern(prefix + pattern), path):
                out[path] = _HF_ALIASES.get(style, style)
    return out


def pins_from_styles(model: nn.Module, styles: dict[str, str], mesh_ndim: int = 1, prefix: str = "") -> dict:
    """``{"layers.*.q_proj": "colwise", ...}`` -> pins for every parameter (unnamed modules replicated)."""
    by_module = _styles_by_module(model, styles, prefix)
    pins = {}
    for path, module in model.named_modules():
        table = _weight_table(module)
        style = by_module.get(path)
        if style is not None and style not in table:
            raise PlanError(f"style {style!r} of {path!r} is not supported: use colwise or rowwise")
        for leaf, param in module.named_parameters(recurse=False):
            placement = "R"
            if style is not None:
                weight, bias = table[style]
                placement = weight if leaf == "weight" else (bias or "R")
            pins[f"{path}.{leaf}" if path else leaf] = ("R",) * (mesh_ndim - 1) + (placement,)
    known = {n for n, _ in model.named_parameters()}
    return {k: v for k, v in pins.items() if k in known}


def _weight_table(module: nn.Module) -> dict:
    if isinstance(module, nn.Embedding):
        return _EMBEDDING
    return _CONV1D if type(module).__name__ == "Conv1D" else _LINEAR


def hf_tp_plan_pins(model: nn.Module, mesh_ndim: int = 1) -> dict:
    """The model's own Hugging Face plan (``config.base_model_tp_plan`` and the head's ``_tp_plan``) as pins."""
    return pins_from_styles(model, _hf_tp_plan(model), mesh_ndim)


def hf_dtensor_plan(model: nn.Module) -> dict:
    """The model's own Hugging Face plan as DTensor's ``parallelize_module`` argument, as transformers runs it:
    column- and row-parallel projections, the embedding split by rows taking replicated ids, and
    ``colwise_gather_output`` (the LM head) returning its output whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
             "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
             "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    out = {}
    for pattern, style in _hf_tp_plan(model).items():
        if style not in kinds:
            raise PlanError(f"Hugging Face style {style!r} of {pattern!r} has no DTensor counterpart here (styles: "
                            f"{', '.join(kinds)}); use hf_tp_plan_pins, which maps it for autotp.plan")
        for path, _ in model.named_modules():
            if re.fullmatch(_pattern(pattern), path):
                out[path] = kinds[style]()
    return out


def _hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """``{module path pattern: Hugging Face style}`` from the base model's plan and the head's."""
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    styles = {prefix + k: v for k, v in base.items()}
    styles.update(getattr(model, "_tp_plan", None) or {})
    if not styles:
        raise PlanError(f"{type(model).__name__} has no Hugging Face tp_plan; pass styles to pins_from_styles")
    return styles


def styles_from_plan(plan, model: nn.Module) -> dict[str, str]:
    """The plan as ``{module path pattern: "colwise" | "rowwise"}``, identical layers collapsed to ``*``.

    Only modules whose weight is split on the last mesh axis alone are named;
    everything else a plan does (activation layouts, vocabulary-parallel loss)
    has no name in this vocabulary and is left out.
    """
    found = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or f"{path}.weight" not in plan.parameters:
            continue
        layout = plan.parameters[f"{path}.weight"]
        if any(p != "R" for p in layout[:-1]):
            continue
        table = _EMBEDDING if isinstance(module, nn.Embedding) else _LINEAR
        for style, (weight, _) in table.items():
            if layout[-1] == weight:
                found[path] = style
    return _collapse(found)


def _collapse(found: dict[str, str]) -> dict[str, str]:
    groups: dict[str, set] = {}
    for path, style in found.items():
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", path), set()).add((path, style))
    out = {}
    for pattern, members in sorted(groups.items()):
        styles = {s for _, s in members}
        if len(styles) == 1 and pattern != next(iter(members))[0]:
            out[pattern] = styles.pop()
        else:
            out.update({p: s for p, s in sorted(members)})
    return out


def dtensor_plan(plan, model: nn.Module) -> dict:
    """The plan as DTensor's ``parallelize_module`` argument: module path -> Colwise/RowwiseParallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out = {}
    for pattern, style in styles_from_plan(plan, model).items():
        for path, _ in model.named_modules():
            if re.fullmatch(_pattern(pattern), path):
                out[path] = styles[style]()
    return out
