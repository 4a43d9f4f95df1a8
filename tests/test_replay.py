"""Layer replay: tracing four layers of a deep stack and copying the last gives the graph a full trace gives.

Every replayed graph is compared with a full trace of the same model, node by
node (target, arguments, shapes, module path), and every model that does not
repeat must fall back to the full trace and say why. One plan made on a
replayed graph runs on real process groups and matches one device.
"""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

import autotp
import hf_models
from autotp.capture import capture
from autotp.capture.replay import MIN_LAYERS, TRACED
from autotp.runtime import spawn
from autotp.runtime.verify import max_errors
from autotp.solve.plan import Plan
from conftest import compute_bound_profile
from models import GPT


def canonical(gm: fx.GraphModule) -> dict:
    """Each node under a name that does not depend on trace order: (module path, op, n-th such op there)."""
    ids, seen = {}, Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            stack = node.meta.get("nn_module_stack") or {}
            key = (list(stack.values())[-1][0] if stack else "", str(node.target))
            ids[node] = key + (seen[key],)
            seen[key] += 1
        else:
            ids[node] = (node.op, str(node.target))

    def name(x):
        return ids[x] if isinstance(x, fx.Node) else x

    def shapes(node):
        return [(tuple(v.shape), v.dtype) for v in pytree.tree_leaves(node.meta.get("val"))
                if isinstance(v, torch.Tensor)]

    return {ids[n]: (repr(fx.node.map_aggregate(n.args, name)), repr(fx.node.map_aggregate(n.kwargs, name)),
                     shapes(n)) for n in gm.graph.nodes}


def gpt(layers: int):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (4, 8))
    return GPT(vocab=64, hidden=32, heads=4, layers=layers, seq=8), (idx, idx), {}


MODELS = {name: (lambda name=name: hf_models.build(name, layers=6)) for name in hf_models.FAMILIES}
MODELS["gpt"] = lambda: gpt(6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_graph_is_the_full_trace(name):
    model, args, kwargs = MODELS[name]()
    replayed = capture(model, args, kwargs)
    full = capture(model, args, kwargs, replay_layers=False)
    assert sum(replayed.meta["autotp_capture"]["replayed"].values()) == 6 - TRACED
    assert full.meta["autotp_capture"]["replayed"] == {}
    assert canonical(replayed) == canonical(full)
    assert dict(replayed.named_parameters()).keys() == dict(full.named_parameters()).keys()
    assert dict(replayed.named_buffers()).keys() == dict(full.named_buffers()).keys()
    assert [n.target for n in replayed.graph.nodes if n.op == "get_attr"] == \
        [n.target for n in full.graph.nodes if n.op == "get_attr"]  # same order: layer sharing compares it


class Block(nn.Module):
    def __init__(self, index: int, variant: str):
        super().__init__()
        self.fc, self.index, self.variant = nn.Linear(8, 8), index, variant

    def forward(self, x):
        y = self.fc(x)
        if self.variant == "scaled":  # a literal that depends on the layer's index
            y = y * (self.index + 1)
        if self.variant.startswith("every") and self.index % int(self.variant[5:]) == int(self.variant[5:]) - 1:
            y = torch.tanh(y)  # an extra op in every n-th layer
        return x + torch.relu(y)


class Deep(nn.Module):
    def __init__(self, layers: int = 6, variant: str = "", collect: bool = False, layer_types=None,
                 again: int | None = None, read_last: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Block(i, variant) for i in range(layers))
        self.collect, self.again, self.read_last = collect, again, read_last
        if layer_types is not None:
            self.config = types.SimpleNamespace(layer_types=layer_types)

    def forward(self, x):
        seen = []
        for layer in self.layers:
            x = layer(x)
            seen.append(x)
        if self.again is not None:  # a forward that names a layer past the traced ones
            x = self.layers[self.again](x)
        if self.read_last:  # the last layer's weight, read from outside the stack
            x = x @ self.layers[-1].fc.weight
        return torch.stack(seen).sum(0) if self.collect else x


def _capture(model):
    return capture(model, (torch.randn(2, 8),))


@pytest.mark.parametrize("model, reason", [
    (Deep(variant="scaled"), "different constants"),
    (Deep(variant="every2"), "different numbers of ops"),
    (Deep(variant="every4"), "different numbers of ops"),
    (Deep(collect=True), "from outside"),
    (Deep(layer_types=["local", "global"] * 3), "config.layer_types differs between layers"),
    (Deep(again=5), "IndexError"),
    (Deep(read_last=True), "from outside layers"),
])
def test_layers_that_do_not_repeat_are_traced_in_full(model, reason):
    gm = _capture(model)
    report = gm.meta["autotp_capture"]
    assert report["replayed"] == {} and reason in report["traced_in_full"]
    assert canonical(gm) == canonical(capture(model, (torch.randn(2, 8),), replay_layers=False))


def test_uniform_layers_replay_and_short_stacks_do_not():
    assert _capture(Deep(layers=MIN_LAYERS)).meta["autotp_capture"] == {
        "replayed": {"layers": MIN_LAYERS - TRACED}, "traced_in_full": None}
    assert _capture(Deep(layers=MIN_LAYERS - 1)).meta["autotp_capture"] == {"replayed": {}, "traced_in_full": None}
    assert _capture(Deep(layers=7, layer_types=["full"] * 7)).meta["autotp_capture"]["replayed"] == {"layers": 3}


def _llama():
    model, args, kwargs = hf_models.build("llama", layers=5, heads=4, kv_heads=2)
    return model, args, kwargs


BUILDERS = {"gpt": lambda: gpt(6), "llama": _llama}


def _run(rank, world, cases):
    errors = []
    for name, plan in cases:
        model, args, kwargs = BUILDERS[name]()
        errors.append(max_errors(model, plan, args, rank, kwargs=kwargs) | {"n": len(list(model.parameters()))})
    return errors


def test_plans_on_replayed_graphs_run_exactly():
    model, args, _ = gpt(6)
    replayed = autotp.plan(model, "2", args, profile=compute_bound_profile())
    full = autotp.plan(model, "2", args, profile=compute_bound_profile(), replay_layers=False)
    assert replayed.stats["capture"]["replayed"] == {"blocks": 2}
    assert replayed.predicted["objective_s"] == pytest.approx(full.predicted["objective_s"], rel=1e-9)
    assert any("S(" in layout[0] for layout in replayed.parameters.values())
    reloaded = Plan.from_dict(replayed.to_dict())  # parallelize captures as the plan says, also after a reload
    assert reloaded.inputs["replay_layers"] is True and full.inputs["replay_layers"] is False
    llama, args, kwargs = _llama()
    llama_plan = autotp.plan(llama, "2", args, kwargs, profile=compute_bound_profile())
    assert llama_plan.stats["capture"]["replayed"] == {"model.layers": 1}
    for rank_errors in spawn(_run, 2, [("gpt", reloaded), ("gpt", full), ("llama", llama_plan)]):
        for errors in rank_errors:
            assert errors["output"] <= 1e-5 and errors["gradient"] <= 1e-5
            assert errors["parameters"] == errors["n"]
