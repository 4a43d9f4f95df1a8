"""Which module each fx node came from (``model.layers.3.self_attn``), read from torch.export's metadata.

Reports use it to fold identical layers into one row; it is recorded in the
plan at planning time because the captured program is gone afterwards.
"""

from __future__ import annotations

import re

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def node_scopes(gm) -> dict[str, str]:
    """``{fx node name: module path}`` for call_function nodes; parameters use their own path."""
    scopes = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op == "call_function" and stack:
            scopes[node.name] = list(stack.values())[-1][0]
    return scopes


def layer_pattern(path: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: what identical layers have in common."""
    return _LAYER_INDEX.sub("*", path)


def layer_indices(path: str) -> tuple[int, ...]:
    """``model.layers.3.mlp`` -> ``(3,)``."""
    return tuple(int(i) for i in _LAYER_INDEX.findall(path))
